"""GPU catalogue, cuBLAS workspace rules, CUDA_VISIBLE_DEVICES mapping and local discovery.

Discovery never touches real hardware here: NVML, nvidia-smi and torch.cuda are replaced by
stubs fed with the recorded-format samples in tests/data/nvidia_smi/.
"""

from __future__ import annotations

import subprocess
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from memcalc.core.gpu import GENERIC
from memcalc.targets.cuda import cublas
from memcalc.targets.cuda.cublas import cublas_workspace_bytes, cublaslt_workspace_bytes
from memcalc.targets.cuda.gpus import local as gpu_local
from memcalc.targets.cuda.gpus.catalogue import AmbiguousGpuError, UnknownGpuError, catalogue, get_gpu, match_profile
from memcalc.targets.cuda.gpus.local import (
    GpuDiscoveryWarning,
    LocalGpu,
    best_gpu,
    list_local_gpus,
    parse_cuda_visible_devices,
    parse_nvidia_smi_csv,
    resolve_device,
    visible_devices,
)

DATA = Path(__file__).parent / "data" / "nvidia_smi"
MiB = 1024**2


def sample(name: str) -> str:
    return (DATA / name).read_text()


def physical(name: str) -> list[tuple[int, str | None]]:
    return [(g.index, g.uuid) for g in parse_nvidia_smi_csv(sample(name))]


# ------------------------------------------------------------------ catalogue


REQUIRED = ["h100-80gb", "h100-pcie", "h200", "a100-40gb", "a100-80gb", "v100-16gb", "v100-32gb",
            "l4", "t4", "a10g", "rtx-3090", "rtx-4090", "generic"]


@pytest.mark.parametrize("key", REQUIRED)
def test_every_required_gpu_resolves_by_key(key):
    assert get_gpu(key).key == key


@pytest.mark.parametrize("spelling, key", [
    ("A100_40GB", "a100-40gb"),
    ("a100-40gb", "a100-40gb"),
    ("A100 40GB", "a100-40gb"),
    ("h100", "h100-80gb"),
    ("H100", "h100-80gb"),
    ("H100 80GB HBM3", "h100-80gb"),
    ("NVIDIA H100 80GB HBM3", "h100-80gb"),
    ("h100 sxm", "h100-80gb"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("Tesla V100-SXM2-16GB", "v100-16gb"),
    ("Tesla T4", "t4"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA A10G", "a10g"),
    ("NVIDIA GeForce RTX 3090", "rtx-3090"),
    ("rtx_4090", "rtx-4090"),
    ("4090", "rtx-4090"),
    ("  Generic ", "generic"),
])
def test_names_resolve_case_and_separator_insensitively(spelling, key):
    assert get_gpu(spelling).key == key


@pytest.mark.parametrize("name, expected", [
    ("a100", {"a100-40gb", "a100-80gb"}),
    ("V100", {"v100-16gb", "v100-32gb"}),
    ("rtx", {"rtx-3090", "rtx-4090"}),
])
def test_ambiguous_names_list_every_candidate(name, expected):
    with pytest.raises(AmbiguousGpuError) as info:
        get_gpu(name)
    assert set(info.value.suggestions) == expected
    assert all(key in str(info.value) for key in expected)
    assert isinstance(info.value, LookupError)


@pytest.mark.parametrize("name, suggestion", [
    ("h10-80gb", "h100-80gb"),
    ("a100-40", "a100-40gb"),
    ("h20", "h200"),          # another card; suggested, never silently picked
    ("rtx-4080", "rtx-4090"),
])
def test_unknown_names_suggest_close_matches(name, suggestion):
    with pytest.raises(UnknownGpuError) as info:
        get_gpu(name)
    assert suggestion in info.value.suggestions
    assert isinstance(info.value, LookupError)
    assert info.value.exit_code == 2


def test_unknown_name_without_neighbours_has_no_suggestions_but_lists_gpus():
    with pytest.raises(UnknownGpuError) as info:
        get_gpu("quux")
    assert info.value.suggestions == []
    assert "h100-80gb" in str(info.value)


def test_bf16_support_follows_compute_capability():
    assert not get_gpu("v100-16gb").supports_bf16
    assert not get_gpu("v100-32gb").supports_bf16
    assert not get_gpu("t4").supports_bf16
    for key in ("a100-40gb", "a100-80gb", "h100-80gb", "h200", "l4", "a10g", "rtx-3090", "rtx-4090"):
        assert get_gpu(key).supports_bf16, key


def test_catalogue_numbers_are_self_consistent():
    for profile in catalogue():
        assert profile.total_memory is not None
        # CUDA's total sits below nvidia-smi's memory.total (the driver's reserve) but close.
        assert profile.smi_total_mib is not None
        smi = profile.smi_total_mib * MiB
        assert 0.9 * smi < profile.total_memory < smi, profile.key
        # the assumed contexts sit in the 300–600 MiB reported publicly; the measured H100's is
        # 693 MiB (its cuBLAS and cuDNN kernels loaded, CUDA 13.0)
        high = 700 * MiB if profile.key == "h100-80gb" else 600 * MiB
        assert 256 * MiB <= profile.cuda_context <= high, profile.key
        assert profile.usable_memory == profile.total_memory - profile.cuda_context
        assert profile.compute_capability >= (7, 0)
    assert catalogue(include_generic=True)[-1] is GENERIC
    assert GENERIC not in catalogue()


def test_reference_capacities():
    assert get_gpu("h100").total_memory == 85_028_896_768
    assert get_gpu("h100").smi_total_mib == 81559
    assert get_gpu("a100-40gb").smi_total_mib == 40960
    assert get_gpu("h200").smi_total_mib == 143771


def test_generic_has_no_capacity():
    assert GENERIC.total_memory is None
    assert GENERIC.usable_memory is None
    assert GENERIC.cuda_context == 512 * MiB
    assert GENERIC.cublas_workspace == 8_519_680
    assert GENERIC.compute_capability == (8, 0)


def test_context_grows_with_sm_count():
    assert get_gpu("t4").cuda_context < get_gpu("a100-40gb").cuda_context < get_gpu("h100").cuda_context
    # the formula's 256 MiB + 132 SMs × 2048 threads × 1 KiB = 520 MiB is replaced on the H100 by
    # the measured 726,663,168 B (tests/data/gpu/2026-11-25-h100/ctx.json, "LAZY" context)
    assert get_gpu("h200").cuda_context == 520 * MiB
    assert get_gpu("h100").cuda_context == 726_663_168


def test_describe_mentions_key_and_capacity():
    assert "h100-80gb" in get_gpu("h100").describe()
    assert "no capacity" in GENERIC.describe()


# ------------------------------------------------------------------ cuBLAS workspaces


def test_default_cublas_workspace_per_arch():
    assert get_gpu("h100").cublas_workspace == 32 * MiB
    assert get_gpu("h200").cublas_workspace == 32 * MiB
    for key in ("a100-80gb", "v100-16gb", "t4", "l4", "rtx-4090"):
        assert get_gpu(key).cublas_workspace == 8_519_680 == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert cublas.default_cublas_workspace((10, 0)) == 8_519_680  # only sm90 exactly


@pytest.mark.parametrize("config, expected", [
    (":4096:8", 32 * MiB),
    (":16:8", 128 * 1024),
    (":4096:2:16:8", 8_519_680),
    (":4096:2:16", 8 * MiB),        # trailing half-pair is ignored by the regex
    ("x:16:8y", 128 * 1024),        # text around a match is ignored
    (":0:0", 0),
])
def test_cublas_workspace_config(config, expected):
    env = {"CUBLAS_WORKSPACE_CONFIG": config}
    assert cublas_workspace_bytes(get_gpu("a100-80gb"), env) == expected
    assert cublas_workspace_bytes(get_gpu("h100"), env) == expected


@pytest.mark.parametrize("config", ["", "garbage", "4096:8", ":4096"])
def test_unparsable_cublas_config_falls_back_to_the_default(config):
    env = {"CUBLAS_WORKSPACE_CONFIG": config}
    assert cublas_workspace_bytes(get_gpu("h100"), env) == 32 * MiB
    assert cublas_workspace_bytes(get_gpu("a100-80gb"), env) == 8_519_680


def test_unset_cublas_config_uses_the_profile_default():
    assert cublas_workspace_bytes(get_gpu("t4"), {}) == 8_519_680


def test_cublaslt_workspace():
    h100, t4 = get_gpu("h100"), get_gpu("t4")
    assert cublaslt_workspace_bytes(h100, {}) == 1 * MiB
    assert cublaslt_workspace_bytes(h100, {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 0
    assert cublaslt_workspace_bytes(h100, {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "yes"}) == 1 * MiB
    assert cublaslt_workspace_bytes(h100, {"CUBLASLT_WORKSPACE_SIZE": "4096"}) == 4 * MiB
    assert cublaslt_workspace_bytes(t4, {"CUBLASLT_WORKSPACE_SIZE": "65536"}) == 8_519_680  # capped
    assert cublaslt_workspace_bytes(h100, {"CUBLASLT_WORKSPACE_SIZE": "junk"}) == 1 * MiB


# ------------------------------------------------------------------ nvidia-smi parsing


def test_parse_one_gpu():
    (gpu,) = parse_nvidia_smi_csv(sample("one_gpu.csv"))
    assert gpu.index == 0
    assert gpu.uuid == "GPU-2f6a1c3e-8d41-4b7a-9c55-0e1f2a3b4c5d"
    assert gpu.name == "NVIDIA A100-SXM4-40GB"
    assert gpu.total_memory == 40960 * MiB
    assert gpu.free_memory == 40327 * MiB
    assert match_profile(gpu.name).key == "a100-40gb"


def test_parse_two_eight_and_mixed():
    assert len(parse_nvidia_smi_csv(sample("two_gpus.csv"))) == 2
    eight = parse_nvidia_smi_csv(sample("eight_h100.csv"))
    assert [g.index for g in eight] == list(range(8))
    assert {g.name for g in eight} == {"NVIDIA H100 80GB HBM3"}
    assert {match_profile(g.name).key for g in eight} == {"h100-80gb"}
    mixed = parse_nvidia_smi_csv(sample("mixed.csv"))
    assert [match_profile(g.name) and match_profile(g.name).key for g in mixed] == ["rtx-3090", "rtx-4090", None]


def test_parse_keeps_a_name_with_a_comma_and_skips_blank_lines():
    (gpu,) = parse_nvidia_smi_csv("\n0, GPU-1, Odd, Name, 100, 50\n\n")
    assert gpu.name == "Odd, Name"
    assert gpu.free_memory == 50 * MiB


@pytest.mark.parametrize("text", [sample("not_available.csv"), "0, GPU-1, NVIDIA L4\n"])
def test_parse_rejects_unreadable_rows(text):
    with pytest.raises(ValueError):
        parse_nvidia_smi_csv(text)


# ------------------------------------------------------------------ CUDA_VISIBLE_DEVICES


TWO = physical("two_gpus.csv")
EIGHT = physical("eight_h100.csv")


@pytest.mark.parametrize("value, boxes, expected", [
    (None, TWO, [0, 1]),              # unset → all, in order
    (None, EIGHT, list(range(8))),
    ("1,0", TWO, [1, 0]),             # reordering: logical 0 = physical 1
    ("2", TWO, []),                   # out of range → nothing visible
    ("0,5,1", EIGHT[:2], [0]),        # stops at the first invalid entry
    ("0,5,1", EIGHT, [0, 5, 1]),
    ("0,0", TWO, []),                 # a repeated device empties the list
    ("1,0,1", TWO, []),
    ("", TWO, []),                    # empty → no devices
    (" 1 , 0 ", TWO, [1, 0]),         # whitespace ignored
    ("0,,1", TWO, [0]),               # empty entry ends the list
    ("0,-1,1", TWO, [0]),             # negative ends the list
    ("1gpu,0", TWO, [1, 0]),          # strtoul-style leading number
    ("gpu0", TWO, []),
    ("3,2,7", EIGHT, [3, 2, 7]),
])
def test_visible_devices_indices(value, boxes, expected):
    assert visible_devices(value, boxes) == expected


def test_visible_devices_by_uuid_and_prefix():
    full = "GPU-a7bfde5d-8151-8a6d-fdfc-b31d020cd2f5"
    assert visible_devices(full, EIGHT) == [2]
    assert visible_devices("GPU-a7bf", EIGHT) == [2]                    # unique prefix
    assert visible_devices("GPU-f5e4,GPU-a7", EIGHT) == [7, 2]
    assert visible_devices("GPU-4d", EIGHT) == []                       # ambiguous prefix: stops
    assert visible_devices("GPU-c1,GPU-4d,GPU-a7", EIGHT) == [4]
    assert visible_devices("GPU-deadbeef,GPU-a7", EIGHT) == []          # unknown: stops
    assert visible_devices(f" {full} , GPU-c1 ", EIGHT) == [2, 4]       # whitespace
    assert visible_devices("GPU-a7,GPU-a7bfde5d", EIGHT) == []          # same GPU twice → empty
    assert visible_devices("2,GPU-a7", EIGHT) == []                     # same GPU, two spellings
    assert visible_devices("5,GPU-a7", EIGHT) == [5, 2]                 # mixed forms (assumed)


def test_visible_devices_mig_is_unsupported_not_fatal():
    assert visible_devices("MIG-0d3a4b5c-1234-5678-9abc-def012345678", TWO) == []
    assert visible_devices("1,MIG-abc", TWO) == [1]


def test_parse_cuda_visible_devices_syntax():
    assert parse_cuda_visible_devices(None) is None
    assert parse_cuda_visible_devices("") == []
    assert parse_cuda_visible_devices("2, GPU-ab ,x,3") == [2, "GPU-ab"]
    assert parse_cuda_visible_devices("+1") == [1]


# ------------------------------------------------------------------ discovery


def smi_runner(text: str, returncode: int = 0):
    calls = []

    def run(args, **kwargs):
        calls.append(args)
        return subprocess.CompletedProcess(args, returncode, stdout=text, stderr="")

    run.calls = calls
    return run


def on_path(name, path=None):
    return f"/usr/bin/{name}"


def not_on_path(name, path=None):
    return None


def no_module():
    return None


def discover(text: str, env: dict[str, str], **overrides):
    options = dict(runner=smi_runner(text), which=on_path, nvml=no_module, torch_cuda=no_module,
                   driver_loaded=lambda: True)
    options.update(overrides)
    return list_local_gpus(env, **options)


def test_no_gpu_on_this_machine():
    """No NVML, no nvidia-smi, no CUDA torch: an empty list, not an error."""
    def exploding_runner(*args, **kwargs):
        raise AssertionError("nvidia-smi must not run when it is not on PATH")

    cpu_torch = SimpleNamespace(is_available=lambda: False)
    assert list_local_gpus({}, runner=exploding_runner, which=not_on_path, nvml=no_module,
                           torch_cuda=lambda: cpu_torch) == []


def test_default_sources_on_a_machine_without_gpus():
    pytest.importorskip("torch")
    import torch

    if gpu_local._import_pynvml() is not None or torch.cuda.is_available():
        pytest.skip("this machine has a GPU stack")

    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    assert list_local_gpus({"PATH": ""}, runner=missing) == []


@pytest.mark.parametrize("failure", [
    dict(runner=smi_runner("", returncode=9)),
    dict(runner=smi_runner("garbage")),
    dict(runner=smi_runner(sample("not_available.csv"))),
])
def test_broken_nvidia_smi_falls_through_quietly(failure):
    assert discover("", {}, **failure) == []


def test_runner_errors_are_swallowed():
    def timeout(args, **kwargs):
        raise subprocess.TimeoutExpired(args, 15)

    assert discover("", {}, runner=timeout) == []


def test_nvidia_smi_source_applies_cuda_visible_devices():
    runner = smi_runner(sample("two_gpus.csv"))
    found = discover("", {"CUDA_VISIBLE_DEVICES": "1,0"}, runner=runner)
    assert runner.calls[0][0] == "/usr/bin/nvidia-smi"
    assert runner.calls[0][1:] == list(gpu_local.NVIDIA_SMI_QUERY[1:])
    assert [(g.logical_index, g.physical_index) for g in found] == [(0, 1), (1, 0)]
    assert found[0].uuid == "GPU-a94f3d10-6e2b-47c8-b135-2d4e6f8a0c12"
    assert found[0].free_memory == 24080 * MiB
    assert found[0].total_memory == 24564 * MiB
    assert found[0].device == "cuda:0"
    assert found[0].profile.key == "rtx-4090"


def test_eight_h100_with_subset():
    found = discover(sample("eight_h100.csv"), {"CUDA_VISIBLE_DEVICES": "3,1"})
    assert [g.physical_index for g in found] == [3, 1]
    assert best_gpu(found).physical_index == 3


def test_invalid_visible_devices_hide_everything():
    assert discover(sample("two_gpus.csv"), {"CUDA_VISIBLE_DEVICES": "2"}) == []
    assert discover(sample("two_gpus.csv"), {"CUDA_VISIBLE_DEVICES": ""}) == []


def test_mixed_models_warn_unless_pci_bus_order():
    with pytest.warns(GpuDiscoveryWarning, match="CUDA_DEVICE_ORDER"):
        found = discover(sample("mixed.csv"), {})
    assert len(found) == 3
    assert found[2].profile is None  # the A40 is not in the catalogue
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        discover(sample("mixed.csv"), {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
        discover(sample("eight_h100.csv"), {})      # identical cards: no doubt
        discover(sample("mixed.csv"), {"CUDA_VISIBLE_DEVICES": "1"})  # one card left


class FakeNvml:
    """The slice of pynvml that discovery uses, fed from a parsed sample."""

    def __init__(self, text: str, fail_init: bool = False, bytes_names: bool = False):
        self.rows = parse_nvidia_smi_csv(text)
        self.fail_init = fail_init
        self.bytes_names = bytes_names
        self.shutdown = False

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlDeviceGetCount(self):
        return len(self.rows)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.rows[index]

    def nvmlDeviceGetUUID(self, handle):
        return handle.uuid.encode() if self.bytes_names else handle.uuid

    def nvmlDeviceGetName(self, handle):
        return handle.name.encode() if self.bytes_names else handle.name

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(total=handle.total_memory, free=handle.free_memory, used=0)


def test_nvml_is_preferred_and_mapped_by_uuid():
    nvml = FakeNvml(sample("eight_h100.csv"), bytes_names=True)

    def forbidden_runner(*args, **kwargs):
        raise AssertionError("nvidia-smi must not run when NVML works")

    found = list_local_gpus({"CUDA_VISIBLE_DEVICES": "GPU-f5e4,GPU-a7bf"}, runner=forbidden_runner,
                            which=on_path, nvml=lambda: nvml, torch_cuda=no_module)
    assert [(g.logical_index, g.physical_index) for g in found] == [(0, 7), (1, 2)]
    assert found[1].uuid == "GPU-a7bfde5d-8151-8a6d-fdfc-b31d020cd2f5"
    assert found[1].name == "NVIDIA H100 80GB HBM3"
    assert nvml.shutdown


def test_failing_nvml_falls_back_to_nvidia_smi():
    nvml = FakeNvml(sample("one_gpu.csv"), fail_init=True)
    found = discover(sample("two_gpus.csv"), {}, nvml=lambda: nvml)
    assert len(found) == 2


def fake_torch_cuda(devices: list[tuple[str, int, int, str]]):
    """torch.cuda stand-in: ``devices`` are (name, total, free, uuid) after CUDA's own filtering."""
    return SimpleNamespace(
        is_available=lambda: bool(devices),
        device_count=lambda: len(devices),
        get_device_properties=lambda i: SimpleNamespace(name=devices[i][0], total_memory=devices[i][1],
                                                        uuid=devices[i][3]),
        mem_get_info=lambda i: (devices[i][2], devices[i][1]),
    )


def test_torch_is_the_last_resort():
    cuda = fake_torch_cuda([("NVIDIA L4", 23_612_293_120, 20 * 1024**3, "0a1b2c3d-0000-4000-8000-000000000000")])
    found = discover("", {}, which=not_on_path, torch_cuda=lambda: cuda)
    assert found == [LocalGpu(0, 0, "NVIDIA L4", "GPU-0a1b2c3d-0000-4000-8000-000000000000",
                              23_612_293_120, 20 * 1024**3)]


def test_torch_source_keeps_physical_index_from_integer_visible_devices():
    cuda = fake_torch_cuda([("NVIDIA L4", 10, 5, "x"), ("NVIDIA L4", 10, 7, "y")])
    found = discover("", {"CUDA_VISIBLE_DEVICES": "3,GPU-y"}, which=not_on_path, torch_cuda=lambda: cuda)
    assert [g.physical_index for g in found] == [3, None]


def test_mig_visible_devices_go_straight_to_torch():
    mig = fake_torch_cuda([("NVIDIA A100-SXM4-40GB MIG 1g.5gb", 4_794_089_472, 4_700_000_000, "MIG-1234")])
    nvml = FakeNvml(sample("one_gpu.csv"))
    found = list_local_gpus({"CUDA_VISIBLE_DEVICES": "MIG-1234"}, runner=smi_runner(sample("one_gpu.csv")),
                            which=on_path, nvml=lambda: nvml, torch_cuda=lambda: mig, driver_loaded=lambda: True)
    assert [(g.name, g.uuid, g.physical_index) for g in found] == [("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "MIG-1234",
                                                                    None)]


def test_torch_is_not_asked_without_a_driver():
    """No NVML, no nvidia-smi and no GPU driver loaded: torch.cuda could see nothing, so it is not
    imported (seconds of `memcalc gpus`), and the answer is the same empty list."""
    def forbidden_torch():
        raise AssertionError("torch must not be imported without a GPU driver")

    assert discover("", {}, which=not_on_path, torch_cuda=forbidden_torch, driver_loaded=lambda: False) == []


def test_a_driver_shows_itself_on_linux(monkeypatch):
    """``/proc/driver/nvidia`` (NVIDIA) or ``/dev/kfd`` (ROCm) present: torch is asked."""
    monkeypatch.setattr(gpu_local.sys, "platform", "linux")
    monkeypatch.setattr(gpu_local.os.path, "exists", lambda path: path == "/dev/kfd")
    assert gpu_local.nvidia_driver_loaded()
    monkeypatch.setattr(gpu_local.os.path, "exists", lambda path: False)
    assert not gpu_local.nvidia_driver_loaded()
    monkeypatch.setattr(gpu_local.sys, "platform", "win32")  # no /proc to read: torch decides
    assert gpu_local.nvidia_driver_loaded()


def test_torch_errors_give_empty_list():
    def boom():
        raise RuntimeError("CUDA driver initialization failed")

    broken = SimpleNamespace(is_available=lambda: True, device_count=boom)
    assert discover("", {}, which=not_on_path, torch_cuda=lambda: broken) == []


# ------------------------------------------------------------------ choosing a device


def two_visible():
    return discover(sample("two_gpus.csv"), {})


@pytest.mark.parametrize("spec, logical", [("cuda:0", 0), ("cuda:1", 1), ("1", 1), ("cuda", 0),
                                           (" CUDA:1 ", 1), ("auto", 1)])
def test_resolve_device(spec, logical):
    assert resolve_device(spec, two_visible()).logical_index == logical


def test_resolve_device_out_of_range_says_how_many_are_visible():
    with pytest.raises(ValueError, match=r"2 GPUs are visible") as info:
        resolve_device("cuda:3", two_visible())
    assert "cuda:3" in str(info.value)
    with pytest.raises(ValueError, match=r"1 GPU is visible"):
        resolve_device("1", discover(sample("one_gpu.csv"), {}))


@pytest.mark.parametrize("spec", ["cuda:-1", "gpu0", "cuda:x", "", "cpu"])
def test_resolve_device_rejects_unreadable_specs(spec):
    with pytest.raises(ValueError, match="auto"):
        resolve_device(spec, two_visible())


def test_resolve_device_with_no_gpu():
    with pytest.raises(ValueError, match="no GPU is visible"):
        resolve_device("auto", [])


def test_auto_picks_most_free_memory_and_breaks_ties_by_index():
    found = discover(sample("eight_h100.csv"), {})
    assert resolve_device("auto", found).logical_index == 0  # 0,2,4,5,6,7 tie at 81079 MiB
    assert best_gpu([]) is None
    reordered = discover(sample("eight_h100.csv"), {"CUDA_VISIBLE_DEVICES": "1,3,6"})
    assert resolve_device("auto", reordered).physical_index == 6
