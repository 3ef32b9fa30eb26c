"""The software stack an estimate assumes (issue 13, item 4): the torch release that keys every
kernel fact, the CUDA version and module loading that size the CUDA context, ``context_mib``,
and the report saying which it assumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import memcalc
from memcalc.cli import main
from memcalc.core.errors import InvalidInputError
from memcalc.core.gpu import GpuProfile
from memcalc.core.stack import Stack
from memcalc.report.render import render_report
from memcalc.targets import versions
from memcalc.targets.budget import resolve_budget
from memcalc.targets.cuda.gpus.catalogue import (
    EAGER_MODULE_LOADING_EXTRA,
    MEASURED_CONTEXTS,
    catalogue,
    cuda_context_bytes,
    get_gpu,
)
from memcalc.targets.cuda.sdpa import AttentionBackend, SdpaCall, choose_sdpa_backend
from memcalc.targets.resolved_stack import (
    installed_torch_version,
    lazy_module_loading,
    resolve_stack,
    supported_torch_versions,
)

MiB = 2**20
INSTALLED = "{}.{}".format(*versions.parse_torch_version(torch.__version__))


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=True)
    return result.exit_code, result.output


# ---- the torch release -------------------------------------------------------------------------
def test_default_is_the_installed_torch() -> None:
    assert installed_torch_version() == INSTALLED
    assert resolve_stack().torch == INSTALLED
    report = memcalc.estimate("mlp", batch_size=4, gpu="t4")
    assert report.torch_version == INSTALLED


def test_supported_range_is_2_4_through_the_installed_one() -> None:
    supported = supported_torch_versions()
    assert supported[0] == "2.4" and supported[-1] == INSTALLED
    assert len(supported) == versions.parse_torch_version(INSTALLED)[1] - 4 + 1


@pytest.mark.parametrize("asked", ["2.3", "1.13", f"2.{versions.parse_torch_version(INSTALLED)[1] + 1}"])
def test_unsupported_torch_is_refused_naming_the_range(asked: str) -> None:
    with pytest.raises(InvalidInputError) as caught:
        memcalc.estimate("mlp", batch_size=4, stack=Stack(torch=asked))
    assert f"torch {asked} is not supported" in str(caught.value)
    assert f"torch 2.4 through {INSTALLED}" in (caught.value.hint or "")


def test_unsupported_torch_on_the_cli_is_a_clear_error() -> None:
    code, out = run("mlp", "--batch", "4", "--torch-version", "2.3")
    assert code == 2
    assert "torch 2.3 is not supported" in out and f"2.4 through {INSTALLED}" in out
    assert "Traceback" not in out


def test_torch_2_4_and_2_11_choose_different_attention_on_hopper() -> None:
    # H100 (sm90.0), bf16: torch 2.11 bundles cuDNN 9.19 (> 9.15), so check_prefer_cudnn_attention
    # puts cuDNN first; 2.4 never prefers cuDNN (it comes after math), so flash runs.
    # gpt2 has 12 layers: 12 SDPA calls.
    def estimate(torch_version: str) -> memcalc.MemoryReport:
        return memcalc.estimate("gpt2", batch_size=2, seq_len=128, precision="amp-bf16", gpu="h100-80gb",
                                stack=Stack(torch=torch_version))

    assert estimate("2.4").attention_calls == (("flash", 12),)
    assert estimate("2.11").attention_calls == (("cudnn", 12),)


def test_blackwell_sdpa_ranges_are_keyed_by_release() -> None:
    # sm120 (RTX 5090): flash and mem-efficient stop at sm90 up to 2.6 → math; 2.7 adds sm100 and
    # sm120 (pytorch#145602). sm121 (DGX Spark) waits for 2.8 (pytorch#152314).
    call = SdpaCall(batch=2, heads_q=4, heads_kv=4, seq_q=128, seq_kv=128, head_dim=64, head_dim_v=64,
                    dtype=torch.bfloat16, has_mask=False, dropout_p=0.0, is_causal=True, requires_grad=True)
    assert choose_sdpa_backend(call, (12, 0), torch_version="2.6") is AttentionBackend.MATH
    assert choose_sdpa_backend(call, (12, 0), torch_version="2.7") is AttentionBackend.FLASH
    assert choose_sdpa_backend(call, (12, 1), torch_version="2.7") is AttentionBackend.MATH
    assert choose_sdpa_backend(call, (12, 1), torch_version="2.8") is AttentionBackend.FLASH
    # the catalogue's GPUs (≤ sm90) are inside every release's range
    assert choose_sdpa_backend(call, (9, 0), torch_version="2.4") is AttentionBackend.FLASH


def test_bundled_cudnn_is_keyed_by_release() -> None:
    # nvidia-cudnn-cu12==9.1.0.70 (2.4), 9.5.1.17 (2.7), 9.10.2.21 (2.8); cu13 9.20.0.48 (2.13)
    assert versions.cudnn_version_of((2, 4), None) == 90100
    assert versions.cudnn_version_of((2, 7), None) == 90501
    assert versions.cudnn_version_of((2, 8), None) == 91002
    assert versions.cudnn_version_of((2, 13), None) == 92000
    assert versions.cudnn_version_of((2, 4), 91900) == 91900  # the caller's wins


# ---- CUDA and its context ----------------------------------------------------------------------
def test_default_cuda_is_the_installed_build_or_the_release_wheel() -> None:
    expected = (("{}.{}".format(*versions.parse_torch_version(torch.version.cuda))) if torch.version.cuda
                else versions.WHEEL_CUDA_VERSION[versions.parse_torch_version(INSTALLED)])
    assert resolve_stack().cuda == expected
    if INSTALLED != "2.4":  # another release: the CUDA of its default PyPI wheel
        assert resolve_stack(Stack(torch="2.4")).cuda == "12.1"
    assert resolve_stack(Stack(cuda="11.8")).cuda == "11.8"


def test_module_loading_follows_cuda_and_the_environment() -> None:
    assert not lazy_module_loading("11.6", {})  # before 11.7: every kernel loaded eagerly
    assert lazy_module_loading("11.7", {})  # PyTorch sets CUDA_MODULE_LOADING=LAZY when unset
    assert not lazy_module_loading("12.4", {"CUDA_MODULE_LOADING": "EAGER"})
    assert lazy_module_loading("11.8", {"CUDA_MODULE_LOADING": "lazy"})
    # DEFAULT is the driver's default: eager before 12.2, lazy from 12.2 on Linux
    assert not lazy_module_loading("12.1", {"CUDA_MODULE_LOADING": "DEFAULT"})
    assert lazy_module_loading("12.2", {"CUDA_MODULE_LOADING": "DEFAULT"})


def test_eager_context_of_the_catalogue_is_about_1_3_gib() -> None:
    for gpu in catalogue():
        if gpu.key in MEASURED_CONTEXTS:  # measured, both ways: test_measured_h100_context_...
            continue
        lazy = cuda_context_bytes(gpu, (12, 4))
        eager = cuda_context_bytes(gpu, (11, 6))
        assert lazy == gpu.cuda_context  # each catalogue figure is the lazy-loading one
        assert eager == lazy + EAGER_MODULE_LOADING_EXTRA
        assert 1000 * 10**6 < eager <= 1.3 * 2**30  # ptrblck's ">1000MB", issue 13's "~1.3 GiB"


def test_cuda_11_6_gives_the_eager_context_in_the_report() -> None:
    # v100-16gb, lazy: 256 MiB + 80 SMs × 2048 threads × 1 KiB = 416 MiB; eager: + 800 MiB = 1,216 MiB
    lazy = memcalc.estimate("mlp", batch_size=4, gpu="v100-16gb", stack=Stack(cuda="12.4"))
    eager = memcalc.estimate("mlp", batch_size=4, gpu="v100-16gb", stack=Stack(cuda="11.6"))
    assert lazy.cuda_context == 416 * MiB
    assert eager.cuda_context == 1216 * MiB
    assert eager.gpu.usable_memory == 16_928_342_016 - 1216 * MiB
    assert eager.capacity == eager.gpu.usable_memory  # fits/headroom are judged under it
    assert eager.headroom == lazy.headroom - 800 * MiB
    assert eager.cuda_version == "11.6" and "eager module loading" in eager.gpu.context_basis
    assert lazy.gpu is get_gpu("v100-16gb")  # lazy loading: the catalogue profile itself


def test_cuda_module_loading_eager_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    report = memcalc.estimate("mlp", batch_size=4, gpu="t4", stack=Stack(cuda="12.4"))
    assert report.cuda_context == (256 + 40 + 800) * MiB  # T4: 40 SMs × 1024 threads × 1 KiB


@pytest.mark.slow  # two fits
def test_cuda_11_6_lowers_the_largest_batch_on_a_16_gib_gpu() -> None:
    def fit(cuda: str) -> memcalc.FitResult:
        return memcalc.max_batch_size("resnet18", gpu="v100-16gb", input_shape=(3, 32, 32), optimizer="sgd",
                                      stack=Stack(cuda=cuda))

    lazy, eager = fit("12.4"), fit("11.6")
    assert lazy.budget_bytes - eager.budget_bytes == 800 * MiB  # budget = total − context
    assert eager.batch_size < lazy.batch_size
    assert eager.report.cuda_context == 1216 * MiB


def test_context_mib_overrides_the_model() -> None:
    report = memcalc.estimate("mlp", batch_size=4, gpu="a100-40gb", stack=Stack(context_mib=700))
    assert report.cuda_context == 700 * MiB
    assert report.capacity == 42_298_834_944 - 700 * MiB
    assert report.gpu.context_basis == "given (--context-mib)"
    budget = resolve_budget(gpu="a100-40gb", stack=Stack(context_mib=700))
    assert budget.capacity == 42_298_834_944 - 700 * MiB
    assert budget.gpu is not None and budget.gpu.cuda_context == 700 * MiB


def test_applying_a_stack_twice_starts_from_the_profile_own_figure() -> None:
    t4 = get_gpu("t4")
    eager = resolve_stack(Stack(cuda="11.6")).apply(t4)
    again = resolve_stack(Stack(cuda="11.6")).apply(eager)
    back = resolve_stack(Stack(cuda="12.4")).apply(again)
    assert eager.cuda_context == again.cuda_context == t4.cuda_context + EAGER_MODULE_LOADING_EXTRA
    assert back.cuda_context == t4.cuda_context


def test_a_users_profile_keeps_its_own_lazy_figure() -> None:
    mine = GpuProfile(key="mine", name="My GPU", total_memory=8 * 2**30, compute_capability=(8, 6), arch="ampere",
                      sm_count=10, supports_bf16=True, cuda_context=300 * MiB, cublas_workspace=8_519_680)
    report = memcalc.estimate("mlp", batch_size=4, gpu=mine, stack=Stack(cuda="11.6"))
    assert report.cuda_context == 1100 * MiB


# ---- what the report says ----------------------------------------------------------------------
def test_cli_prints_the_assumed_versions() -> None:
    code, out = run("mlp", "--batch", "4", "--gpu", "t4", "--torch-version", "2.4", "--cuda-version", "11.6")
    assert code == 0, out
    assert (f"assumed: torch 2.4's kernel rules (traced with the installed torch {INSTALLED}), CUDA 11.6; "
            "CUDA context 1,096.00 MiB (eager module loading: CUDA < 11.7)") in out
    code, out = run("mlp", "--batch", "4", "--gpu", "t4", "--context-mib", "1000")
    assert code == 0, out
    assert f"assumed: torch {INSTALLED}, CUDA " in out and "CUDA context 1,000.00 MiB (given (--context-mib))" in out


def test_json_has_the_versions() -> None:
    code, out = run("mlp", "--batch", "4", "--gpu", "t4", "--torch-version", "2.4", "--format", "json")
    assert code == 0, out
    data = json.loads(out)
    assert data["torch_version"] == "2.4"
    assert data["cuda_version"] == resolve_stack(Stack(torch="2.4")).cuda
    assert data["bytes"]["cuda_context"] == get_gpu("t4").cuda_context


def test_cpu_target_names_no_cuda() -> None:
    report = memcalc.estimate("mlp", batch_size=4, gpu="cpu")
    assert report.torch_version == INSTALLED and report.cuda_version == ""


# ---- the measured H100 context ---------------------------------------------------------------


def test_measured_h100_context_comes_from_the_shared_data() -> None:
    ctx = json.loads((Path(__file__).parent / "data" / "gpu" / "2026-11-25-h100" / "ctx.json").read_text())
    lazy, eager = (json.loads(ctx[mode])["context"] for mode in ("LAZY", "EAGER"))
    h100 = get_gpu("h100-80gb")
    assert cuda_context_bytes(h100, (13, 0)) == lazy == 726_663_168  # 693.0 MiB
    assert cuda_context_bytes(h100, (13, 0), lazy_loading=False) == eager == 2_039_480_320  # 1,945.0 MiB
    # a card not measured keeps the assumption: 256 MiB + 132 SMs × 2048 threads × 1 KiB, + 800 MiB eager
    h200 = get_gpu("h200")
    assert cuda_context_bytes(h200, (13, 0), lazy_loading=False) == (520 + 800) * MiB


def test_report_says_which_context_is_measured() -> None:
    measured = memcalc.estimate("mlp", batch_size=4, gpu="h100-80gb", stack=Stack(cuda="13.0"))
    assert measured.gpu.context_basis == "lazy module loading, measured on NVIDIA H100 80GB HBM3, CUDA 13.0"
    text = render_report(measured)
    assert "CUDA context 693.00 MiB (lazy module loading, measured on NVIDIA H100 80GB HBM3, CUDA 13.0)" in text
    assert "(measured for h100-80gb)" in text
    other_cuda = memcalc.estimate("mlp", batch_size=4, gpu="h100-80gb", stack=Stack(cuda="12.4"))
    assert other_cuda.gpu.context_basis.endswith("CUDA 13.0; assumed the same for CUDA 12.4")
    assumed = memcalc.estimate("mlp", batch_size=4, gpu="h200", stack=Stack(cuda="13.0"))
    assert assumed.gpu.context_basis == "" and "(assumed for h200)" in render_report(assumed)
