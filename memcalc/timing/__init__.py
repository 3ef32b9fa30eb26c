"""Step time: the FLOPs and bytes of every kernel recorded while the step is traced
(:mod:`~memcalc.timing.flops`, handed to the engine as its cost recorder when a time is asked
for), the roofline on a GPU's datasheet peaks with coefficients fitted to real kernels
(:mod:`~memcalc.timing.performance`, :mod:`~memcalc.timing.calibration`, and the fit's
output :mod:`~memcalc.timing.fitted`), and its text (:mod:`~memcalc.timing.time_render`).

The records it produces (``StepFlops``, ``DeviceRates``, ``StepTime``) are vocabulary, in
:mod:`memcalc.core.throughput`, so that a report can hold them; the search for the fastest
setting that fits is a search (:mod:`memcalc.search.throughput`).
"""
