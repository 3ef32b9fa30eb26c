"""The strategies as objects, one per file: each mesh dimension (``dp_replicate``, ``dp_shard``,
and the dimensions to come) and each strategy that is not one (DataParallel, DeepSpeed ZeRO).
The interface is :class:`~memcalc.distributed.strategy.base.RankStrategy`; the catalogue
(:mod:`~memcalc.distributed.strategy.catalogue`) finds them."""
