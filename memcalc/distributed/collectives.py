"""What a step communicates, and how long that takes: the collective cost model of ``memcalc plan``.

Each mesh dimension says which collectives one of its ranks runs per optimizer step
(:meth:`~memcalc.distributed.strategy.base.RankStrategy.collectives`), as bytes *received* per
rank by a ring algorithm (NCCL's, for a large message): an all-gather or a reduce-scatter of
``S`` bytes over ``n`` ranks moves ``S × (n − 1) / n`` into each rank, an all-reduce twice that.
A collective's seconds are those bytes over the bandwidth of its group's slowest link: NVLink
when every rank of the group is in one node, the network otherwise (:class:`Network`). Ranks
are laid out as torchtitan lays out its mesh (``pp, dp_replicate, dp_shard, cp, tp``, the
last innermost: ``tp`` on neighbouring GPUs), so a group spans ``stride × degree`` consecutive
GPUs, ``stride`` being the product of the inner dimensions' degrees.

Latency (per-message start-up) is not modelled: at these sizes (MBs per block) bandwidth
dominates. A collective is ``overlapped`` when it can run beside compute (FSDP's prefetched
all-gathers, gradient reductions, a pipeline's sends in its steady state) and exposed otherwise
(tensor parallelism's activation all-gathers and reduce-scatters, which each block waits on);
or partly, beside a known compute per call (``beside``: context parallelism's ring, each exchange
beside one local attention call), each call exposed by what exceeds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memcalc.core.checkpointing import OFF, Checkpointing, CheckpointKind
from memcalc.core.errors import InvalidInputError
from memcalc.distributed.mesh import Mesh

if TYPE_CHECKING:  # torch's styles are read where the traffic is made (plan's model facts)
    from memcalc.distributed.tp_traffic import Transfer

__all__ = ("DEFAULT_NETWORK", "LAYOUT", "Collective", "ModelFacts", "Network", "group_span", "ring_bytes")

#: The mesh's dimensions from outermost to innermost (torchtitan's ``ParallelDims._build_mesh``).
LAYOUT = ("pp", "dp_replicate", "dp_shard", "cp", "ep", "tp")

_GB = 1e9
#: The checkpointing whose recomputation re-runs a checkpointed block's collectives.
_RECOMPUTING = frozenset({CheckpointKind.FULL, CheckpointKind.SELECTIVE_OP, CheckpointKind.EVERY})


@dataclass(frozen=True)
class Network:
    """The links between GPUs, each in GB/s (10**9 bytes per second) received per GPU.

    Defaults are H100-class (DGX H100 / HGX H100):

    - ``intra_node_gbps``: NVLink 4, 900 GB/s per GPU in both directions, 450 GB/s each way
      (NVIDIA H100 Tensor Core GPU datasheet, "NVLink: 900GB/s"). NCCL's measured bus bandwidth
      within a node is lower (~360-400 GB/s); give that with ``--intra-node-gbps`` to be conservative.
    - ``inter_node_gbps``: one ConnectX-7 400 Gb/s InfiniBand NIC per GPU, 50 GB/s each way
      (NVIDIA DGX H100 datasheet: "8x single-port ConnectX-7, 400 Gb/s InfiniBand/Ethernet").
    - ``gpus_per_node``: 8.
    """

    gpus_per_node: int = 8
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise InvalidInputError(f"the GPUs per node must be a positive integer, got {self.gpus_per_node!r}")
        for name in ("intra_node_gbps", "inter_node_gbps"):
            value = getattr(self, name)
            if not value > 0:
                flag = name.replace("_", "-")
                raise InvalidInputError(f"the {flag} bandwidth must be positive (GB/s), got {value!r}")

    def bandwidth(self, span: int) -> float:
        """Bytes per second into a rank of a group spanning ``span`` consecutive GPUs."""
        return (self.intra_node_gbps if span <= self.gpus_per_node else self.inter_node_gbps) * _GB

    def describe(self) -> str:
        return (f"{self.gpus_per_node} GPUs per node; NVLink {self.intra_node_gbps:g} GB/s within a node, "
                f"{self.inter_node_gbps:g} GB/s between nodes (per GPU, each way)")

    def to_dict(self) -> dict[str, float]:
        return {"gpus_per_node": self.gpus_per_node, "intra_node_gbps": self.intra_node_gbps,
                "inter_node_gbps": self.inter_node_gbps}


DEFAULT_NETWORK = Network()


@dataclass(frozen=True)
class ModelFacts:
    """What a dimension needs to know of a model to say its valid degrees and its traffic.

    Attributes:
        parameters: the parameter count (tied weights once).
        trainable: the trainable parameter count (whose gradients are reduced).
        gather_bytes: bytes per parameter as gathered or replicated for compute (2 under FSDP's
            bf16 ``param_dtype``, else the stored dtype's).
        reduce_bytes: bytes per gradient element as reduced (FSDP's ``reduce_dtype``; DDP's: the
            gradients' dtype).
        layers, heads, kv_heads: the transformer's block count and attention heads; None when
            the model is not one (a dimension that needs them then offers degree 1 only).
        hidden, vocab, intermediate: the hidden size, the vocabulary and the MLP's width (None:
            not a transformer, or not said), whose activations tensor and pipeline parallelism move;
            for a mixture of experts the narrowest width a token passes through (``top_k`` times an
            expert's, where that is below the dense ``intermediate_size``): plan's activation floor
            must not exceed any block's.
        activation_bytes: bytes per activation element as computed (2 under amp-bf16).
        tokens, stages_per_rank, recompute: the candidate's, set by ``memcalc plan`` per
            configuration: tokens of one micro-batch on one rank (micro-batch × sequence; 0:
            activations' traffic not counted), pipeline stages per rank (interleaved: 2), and
            whether the backward re-runs the forward's collectives (full checkpointing).
        seq_len, attention_flops_per_second: the candidate's tokens per sample on one rank
            (``S / cp``) and the rate its attention calls are taken to run at (the GPU's dense
            peak: the least time a call can take, so the ring's exposed share is not understated;
            0: the ring hides behind nothing).
        experts, top_k, moe_layers: a mixture of experts' experts per MoE layer, the experts each
            token is routed to and the MoE layers (the modules its expert-parallel plan dispatches
            to); None, None, 0: no experts (``ep`` then offers degree 1 only).
        expert_parameters, expert_trainable: the parameters of those layers' experts (and the
            trainable ones): ep splits them, FSDP2 shards them over dp_shard only.
        checkpoint: the candidate's checkpointing as it runs (``--checkpoint auto``: as chosen after the
            trace; before it, ``auto`` itself, which re-runs nothing: a bound): which blocks' forward
            collectives the backward re-runs (:meth:`recomputes`).
        stream_bytes: bytes per element of the parameters' stored dtype (float32 under autocast,
            whose matmuls alone run in 16 bits), a block's residual stream's where nothing casts
            them (:meth:`stream_bytes_under`).
        moe_blocks: the blocks (0-based, model order) that hold the MoE layers.
        tp_traffic, tp_traffic_ep: the collectives the model's own tensor-parallel plan runs
            (:func:`~memcalc.distributed.tp_traffic.plan_traffic`), without ep and under it (tp × ep:
            the plan without the rules on the experts); None where the plan is not one those rules
            read (tp's closed formula stands); ``tp_traffic_ep`` None for a model without experts.
    """

    parameters: int
    trainable: int
    gather_bytes: int
    reduce_bytes: int
    layers: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    hidden: int | None = None
    vocab: int | None = None
    intermediate: int | None = None
    activation_bytes: int = 2
    tokens: int = 0
    stages_per_rank: int = 1
    recompute: bool = False
    seq_len: int = 0
    attention_flops_per_second: float = 0.0
    experts: int | None = None
    top_k: int | None = None
    moe_layers: int = 0
    expert_parameters: int = 0
    expert_trainable: int = 0
    checkpoint: Checkpointing = OFF
    stream_bytes: int = 4
    moe_blocks: tuple[int, ...] = ()
    tp_traffic: tuple[Transfer, ...] | None = None
    tp_traffic_ep: tuple[Transfer, ...] | None = None

    def recomputes(self, block: int) -> bool:
        """Whether the backward re-runs ``block``'s forward collectives: full and selective-op
        (whose saved ops, torchtitan's, include no all-to-all, all-reduce or all-gather) every block,
        ``every:N`` its blocks; off, and ``auto`` before its choice, none."""
        kind = self.checkpoint.kind
        return kind in _RECOMPUTING and self.checkpoint.checkpoints_block(block)

    def stream_bytes_under(self, mesh: Mesh) -> int:
        """Bytes per element of a block's residual stream on ``mesh``: what a MoE layer dispatches
        and combines (transformers' ``AllToAllEP`` on the block's hidden states) and a column-wise
        layer's input gradient. The parameters' dtype during the forward: FSDP2's ``param_dtype``
        (``gather_bytes``) where its MixedPrecisionPolicy runs the model without autocast (dp_shard,
        and dp_replicate's HSDP over ep without dp_shard or cp: their ``trace_precision``), else
        the stored dtype (autocast casts the matmuls' inputs alone). A traced tiny Mixtral under
        amp-bf16 dispatches float32 rows at tp=2 × ep=2, bfloat16 ones with dp_shard or HSDP."""
        fsdp = mesh.dp_shard > 1 or (mesh.dp_replicate > 1 and mesh.ep > 1 and mesh.cp == 1)
        return self.gather_bytes if fsdp else self.stream_bytes

    @property
    def recomputed_moe_layers(self) -> int:
        """The MoE layers whose forward collectives the backward re-runs (:meth:`recomputes`)."""
        return sum(self.recomputes(block) for block in self.moe_blocks)


@dataclass(frozen=True)
class Collective:
    """One kind of collective a rank runs: ``count`` calls per optimizer step, ``received`` bytes
    into the rank in all, over a group spanning ``span`` consecutive GPUs."""

    dimension: str
    what: str  # "all-gather of parameters (forward and backward)"
    received: float
    span: int
    count: int = 1
    overlapped: bool = True
    beside: float | None = None  # seconds of compute each call runs beside; None: ``overlapped`` says all

    def seconds(self, network: Network) -> float:
        """The seconds of these bytes on the group's slowest link."""
        return self.received / network.bandwidth(self.span)

    def exposed_seconds(self, network: Network) -> float:
        """The seconds no compute hides: none if overlapped, all if not; with ``beside``, each
        call's excess over the compute it runs beside (``count × max(0, per call − beside)``)."""
        seconds = self.seconds(network)
        if self.beside is None:
            return 0.0 if self.overlapped else seconds
        return self.count * max(0.0, seconds / self.count - self.beside)

    def to_dict(self, network: Network) -> dict[str, object]:
        return {"dimension": self.dimension, "what": self.what, "bytes_received": self.received,
                "group_span": self.span, "intra_node": self.span <= network.gpus_per_node,
                "overlapped": self.overlapped, "seconds": self.seconds(network),
                "exposed_seconds": self.exposed_seconds(network)}


def ring_bytes(size: float, n: int) -> float:
    """Bytes a rank receives in a ring all-gather or reduce-scatter of ``size`` bytes (the whole,
    unsharded tensor) over ``n`` ranks: ``size × (n − 1) / n``."""
    return size * (n - 1) / n


def group_span(mesh: Mesh, dimension: str) -> int:
    """Consecutive GPUs one group of ``dimension`` spans: its degree × the inner dimensions'."""
    degrees = mesh.degrees
    stride = 1
    for inner in LAYOUT[LAYOUT.index(dimension) + 1:]:
        stride *= degrees[inner]
    return stride * degrees[dimension]
