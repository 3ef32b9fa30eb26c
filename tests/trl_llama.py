"""The tiny Llama the TRL loop tests train (tests/test_trl_loops.py, test_trl_strategies.py,
test_trl_zero3.py), and its fp32 parameter bytes worked out by hand, so the three files check the
same model against the same arithmetic."""

from __future__ import annotations

HIDDEN, VOCAB, LAYERS = 128, 8192, 2
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN,
          "intermediate_size": 2 * HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 1024,
          "tie_word_embeddings": False}
# The Llama's parameters, fp32: embedding and LM head V·H each; per layer q, o H·H, k, v H·(H/2) (2 of 4
# heads' width), gate, up, down H·2H each, two norms H; the final norm H. Every count is even, so a
# 2-rank partition is exactly half.
LAYER = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * HIDDEN // 2 + 3 * HIDDEN * 2 * HIDDEN + 2 * HIDDEN
P = 4 * (2 * VOCAB * HIDDEN + LAYERS * LAYER + HIDDEN)  # 9,570,816 B
