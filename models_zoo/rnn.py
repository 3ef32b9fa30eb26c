"""LSTM language model: Zaremba, Sutskever & Vinyals 2014, "medium" configuration.

Embedding 10000 x 650 → dropout → 2-layer LSTM (650 hidden, dropout 0.5 between layers) →
dropout → untied linear decoder to 10000 words, unrolled over 35 steps: the Penn Treebank
setup of the paper and of PyTorch's ``examples/word_language_model``. ``nn.LSTM`` keeps two
bias vectors per gate (``b_ih`` and ``b_hh``, the cuDNN convention) where the paper's Torch
code had one, so the count is 2 x 4 x 650 per layer higher than a single-bias LSTM.

The recurrent state starts at zero every batch (``nn.LSTM``'s default), so no state is
carried between steps of training.
"""

from __future__ import annotations

from torch import Tensor, nn

from .registry import InputKind, LossKind, ZooEntry, register


class LSTMLanguageModel(nn.Module):
    def __init__(self, vocab_size: int = 10000, hidden: int = 650, num_layers: int = 2, dropout: float = 0.5):
        super().__init__()
        self.encoder = nn.Embedding(vocab_size, hidden)
        self.drop = nn.Dropout(dropout)
        self.rnn = nn.LSTM(hidden, hidden, num_layers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab_size)

    def forward(self, input_ids: Tensor) -> Tensor:
        """Logits ``(B, T, vocab)``."""
        out, _ = self.rnn(self.drop(self.encoder(input_ids)))
        logits: Tensor = self.decoder(self.drop(out))
        return logits


register(
    ZooEntry(
        name="lstm-lm",
        family="rnn",
        builder=lambda shape: LSTMLanguageModel(),
        input_kind=InputKind.TOKENS,
        default_shape=(35,),
        loss=LossKind.LM_CROSS_ENTROPY,
        reference_parameters=19_780_400,
        vocab_size=10000,
        description="Zaremba et al. 2014 medium LSTM LM: 2 x 650 LSTM, vocab 10000, 35 steps, "
                    "dropout 0.5, untied decoder",
        aliases=("zaremba-medium",),
    )
)
