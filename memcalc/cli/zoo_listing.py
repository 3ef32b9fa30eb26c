"""The model zoo's entries as plain data, for ``memcalc zoo`` (:class:`memcalc.cli.zoo.ZooListed`
fields, in registration order). Written by scripts/write_zoo_listing.py from models_zoo's registry:
do not edit; tests/test_startup.py checks it against the registry."""

# ruff: noqa: E501  (one row per entry, as long as its names)

from __future__ import annotations

__all__ = ("ZOO_LISTING",)

ZOO_LISTING: tuple[tuple[str, str, int | None, int | None, str, str | None, bool], ...] = (
    ('bert-base', 'bert', 109482240, 109514298, 'seq 512, vocab 30522', 'BertForMaskedLM', True),
    ('bert-large', 'bert', 335141888, 335174458, 'seq 512, vocab 30522', 'BertForMaskedLM', True),
    ('densenet121', 'densenet', 7978856, None, '3x224x224', None, True),
    ('mobilenet_v2', 'mobilenet', 3504872, None, '3x224x224', None, True),
    ('mobilenet_v3_large', 'mobilenet', 5483032, None, '3x224x224', None, True),
    ('efficientnet_b0', 'efficientnet', 5288548, None, '3x224x224', None, True),
    ('gemma-2-2b', 'gemma2', 2614341888, 2614341888, 'seq 8192, vocab 256000', 'Gemma2ForCausalLM', True),
    ('gemma-2-9b', 'gemma2', 9241705984, 9241705984, 'seq 8192, vocab 256000', 'Gemma2ForCausalLM', True),
    ('gpt2', 'gpt2', 124439808, 124439808, 'seq 1024, vocab 50257', 'GPT2LMHeadModel', True),
    ('gpt2-medium', 'gpt2', 354823168, 354823168, 'seq 1024, vocab 50257', 'GPT2LMHeadModel', True),
    ('gpt2-large', 'gpt2', 774030080, 774030080, 'seq 1024, vocab 50257', 'GPT2LMHeadModel', True),
    ('gpt2-xl', 'gpt2', 1557611200, 1557611200, 'seq 1024, vocab 50257', 'GPT2LMHeadModel', True),
    ('llama-2-7b', 'llama', 6738415616, 6738415616, 'seq 4096, vocab 32000', 'LlamaForCausalLM', True),
    ('llama-2-13b', 'llama', 13015864320, 13015864320, 'seq 4096, vocab 32000', 'LlamaForCausalLM', True),
    ('llama-2-70b', 'llama', 68976648192, 68976648192, 'seq 4096, vocab 32000', 'LlamaForCausalLM', True),
    ('llama-tiny', 'llama', 54927872, 54927872, 'seq 512, vocab 32000', 'LlamaForCausalLM', True),
    ('llama-3-8b', 'llama', 8030261248, 8030261248, 'seq 8192, vocab 128256', 'LlamaForCausalLM', True),
    ('llama-3-70b', 'llama', 70553706496, 70553706496, 'seq 8192, vocab 128256', 'LlamaForCausalLM', True),
    ('llama-3.1-405b', 'llama', 405853388800, 405853388800, 'seq 8192, vocab 128256', 'LlamaForCausalLM', True),
    ('mistral-7b', 'mistral', 7241732096, 7241732096, 'seq 8192, vocab 32000', 'MistralForCausalLM', True),
    ('qwen2.5-7b', 'qwen2', 7615616512, 7615616512, 'seq 8192, vocab 152064', 'Qwen2ForCausalLM', True),
    ('mlp', 'mlp', 1863690, None, '784', None, True),
    ('fc-32-16', 'mlp', 512, None, '32', None, True),
    ('mixtral-8x7b', 'mixtral', 46702792704, 46702792704, 'seq 4096, vocab 32000', 'MixtralForCausalLM', False),
    ('qwen3-30b-a3b', 'qwen3_moe', 30532122624, 30532122624, 'seq 4096, vocab 151936', 'Qwen3MoeForCausalLM', False),
    ('deepseek-v3', 'deepseek_v3', 671026404352, 671026404352, 'seq 4096, vocab 129280', 'DeepseekV3ForCausalLM', False),
    ('gpt-oss-20b', 'gpt_oss', 20914757184, 20914757184, 'seq 4096, vocab 201088', 'GptOssForCausalLM', False),
    ('resnet18', 'resnet', 11689512, None, '3x224x224', None, True),
    ('resnet34', 'resnet', 21797672, None, '3x224x224', None, True),
    ('resnet50', 'resnet', 25557032, None, '3x224x224', None, True),
    ('resnet101', 'resnet', 44549160, None, '3x224x224', None, True),
    ('resnet152', 'resnet', 60192808, None, '3x224x224', None, True),
    ('lstm-lm', 'rnn', 19780400, None, 'seq 35, vocab 10000', None, True),
    ('unet', 'unet', 31037698, None, '3x572x572', None, True),
    ('vgg11', 'vgg', 132863336, None, '3x224x224', None, True),
    ('vgg16', 'vgg', 138357544, None, '3x224x224', None, True),
    ('vgg19', 'vgg', 143667240, None, '3x224x224', None, True),
    ('vit_b_16', 'vit', 86567656, None, '3x224x224', None, True),
    ('vit_l_16', 'vit', 304326632, None, '3x224x224', None, True),
)
