"""A Hugging Face model's head and the labels its own loss reads: the one home of what memcalc
knows about how a ``transformers`` model trains.

**The head** is the class the config's ``architectures`` names (``BertForSequenceClassification``,
``LlamaForCausalLM``), built by transformers itself (``_from_config``, as ``AutoModelFor*.from_config``
does); a config that names none, or a class the installed transformers lacks, falls back to
``AutoModelForCausalLM``, then ``AutoModel``. Its kind (:class:`Head`) is read from transformers'
own Auto mappings (``transformers.models.auto.modeling_auto.MODEL_FOR_*_MAPPING_NAMES``), not
from the class name.

**The loss** is the model's own: ``Trainer.compute_loss`` calls ``model(**inputs)`` with
``labels`` in the batch and trains with ``outputs.loss``. So a training step whose loss the user
did not choose passes the labels each head's loss needs (:func:`labels_maker`) as keyword
arguments, and :mod:`memcalc.engine.step` trains with ``output.loss``: transformers' loss
functions as installed (``transformers.loss.loss_utils``: ``ForCausalLMLoss`` upcasts the logits
to float32 before the cross-entropy; ``ForSequenceClassificationLoss`` picks cross-entropy, MSE or
BCE from ``num_labels``), traced on meta like the rest of the forward. The labels are random but
valid: token ids below the vocabulary, class ids below ``num_labels``, answer positions inside the
sequence.
"""

from __future__ import annotations

import enum
from types import ModuleType
from typing import Any

import torch
from torch import nn

from memcalc.engine.model import LabelsMaker, ModelInputs

__all__ = ("Head", "head_of", "labels_maker", "named_architecture", "settle_loss_type")

#: The loss transformers falls back to for a model whose class name names none of its losses
#: (``PreTrainedModel.loss_function``, modeling_utils.py).
_FALLBACK_LOSS = "ForCausalLM"


class Head(str, enum.Enum):
    """What a Hugging Face model's head predicts, and so which labels its loss takes."""

    CAUSAL_LM = "causal-lm"  # labels (B, T): the next token (the model shifts them)
    MASKED_LM = "masked-lm"  # labels (B, T): the token at each position
    SEQ2SEQ = "seq2seq"  # labels (B, T): the decoder's targets (its inputs are the labels shifted right)
    SEQUENCE_CLASSIFICATION = "sequence-classification"  # labels (B,): a class (a float with num_labels 1)
    TOKEN_CLASSIFICATION = "token-classification"  # labels (B, T): a class per token
    QUESTION_ANSWERING = "question-answering"  # start_positions, end_positions (B,)


#: The Auto class that builds each head from a config (``--task``: the head asked for, not the
#: one ``architectures`` names).
AUTO_CLASSES: dict[Head, str] = {
    Head.CAUSAL_LM: "AutoModelForCausalLM",
    Head.MASKED_LM: "AutoModelForMaskedLM",
    Head.SEQ2SEQ: "AutoModelForSeq2SeqLM",
    Head.SEQUENCE_CLASSIFICATION: "AutoModelForSequenceClassification",
    Head.TOKEN_CLASSIFICATION: "AutoModelForTokenClassification",
    Head.QUESTION_ANSWERING: "AutoModelForQuestionAnswering",
}


#: transformers' Auto mappings (model type → class name) that say what each head is, in the
#: order they are asked: BART's conditional-generation class is in the masked-LM mapping too.
_MAPPINGS: tuple[tuple[str, Head], ...] = (
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", Head.SEQ2SEQ),
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", Head.CAUSAL_LM),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", Head.MASKED_LM),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", Head.SEQUENCE_CLASSIFICATION),
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", Head.TOKEN_CLASSIFICATION),
    ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", Head.QUESTION_ANSWERING),
)


def named_architecture(transformers: ModuleType, config: Any) -> type[nn.Module] | None:
    """The model class the config's ``architectures`` names first, when the installed
    transformers has it (None: the config names none, or an unknown one)."""
    names = getattr(config, "architectures", None) or ()
    model_class = getattr(transformers, names[0], None) if names else None
    return model_class if isinstance(model_class, type) and issubclass(model_class, nn.Module) else None


def settle_loss_type(model: nn.Module) -> None:
    """Give ``model`` the loss transformers would fall back to, where its class names none.

    transformers picks a model's loss by its class name (``PreTrainedModel.__init__`` sets
    ``loss_type`` from it); a class that names none, such as ``GPT2LMHeadModel``, gets
    ``loss_type=None``, and its first ``loss_function`` logs "`loss_type=None` was set in the
    config but it is unrecognized" and uses ``ForCausalLMLoss`` (transformers 5.24,
    modeling_utils.py). That warning would land in memcalc's report; the same loss is set here
    without it. A model that names its loss, or has no ``loss_type``, is left as it is.
    """
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:
        return
    if getattr(model, "loss_type", "") is None and _FALLBACK_LOSS in LOSS_MAPPING:
        setattr(model, "loss_type", _FALLBACK_LOSS)  # noqa: B010  (nn.Module's typed attributes are tensors)


def head_of(module: nn.Module) -> Head | None:
    """The head of a transformers model, from transformers' Auto mappings (None: a bare model
    such as ``BertModel``, or a class no mapping names)."""
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        return None
    name = type(module).__name__
    for mapping_name, head in _MAPPINGS:
        mapping = getattr(modeling_auto, mapping_name, {})
        for classes in mapping.values():
            if name == classes or (isinstance(classes, tuple) and name in classes):
                if head is Head.SEQ2SEQ and not getattr(getattr(module, "config", None), "is_encoder_decoder", False):
                    break  # a decoder-only "ForConditionalGeneration" (vision-language): not seq2seq here
                return head
    return None


def labels_maker(module: nn.Module) -> LabelsMaker | None:
    """The labels a training step adds to the batch of ``module`` (None: a head without labels
    memcalc knows, or a model that does not take them: memcalc's own loss then applies)."""
    head = head_of(module)
    config = getattr(module, "config", None)
    if head is None or config is None:
        return None
    if head in (Head.CAUSAL_LM, Head.MASKED_LM, Head.SEQ2SEQ):
        vocab = int(config.vocab_size)
        return lambda inputs: {"labels": _randint(vocab, _tokens(inputs))}
    classes = int(getattr(config, "num_labels", 2))
    if head is Head.TOKEN_CLASSIFICATION:
        return lambda inputs: {"labels": _randint(classes, _tokens(inputs))}
    if head is Head.SEQUENCE_CLASSIFICATION:
        return lambda inputs: {"labels": _sequence_labels(classes, config, _tokens(inputs))}
    return lambda inputs: {name: _randint(_tokens(inputs).shape[-1], _tokens(inputs)[..., 0])
                           for name in ("start_positions", "end_positions")}


def _tokens(inputs: ModelInputs) -> torch.Tensor:
    """The batch's token ids: ``input_ids`` by name, else the first integer tensor."""
    named = inputs.kwargs.get("input_ids")
    if isinstance(named, torch.Tensor):
        return named
    return next((t for t in inputs if not t.is_floating_point()), inputs[0])


def _randint(high: int, like: torch.Tensor) -> torch.Tensor:
    return torch.randint(0, max(high, 1), tuple(like.shape), device=like.device)


def _sequence_labels(classes: int, config: Any, tokens: torch.Tensor) -> torch.Tensor:
    """One label per sample, of the dtype that makes ``ForSequenceClassificationLoss`` pick the
    loss the config asks for: float targets for regression (``num_labels`` 1) and multi-label
    (``problem_type``), class ids otherwise."""
    batch = tokens.shape[:1]
    problem = getattr(config, "problem_type", None)
    if classes == 1 or problem == "regression":
        return torch.randn((*batch, classes) if classes > 1 else batch, device=tokens.device)
    if problem == "multi_label_classification":
        return torch.randint(0, 2, (*batch, classes), device=tokens.device).float()
    return torch.randint(0, classes, batch, device=tokens.device)
