"""``hf:ORG/NAME[@revision]``: a Hub model's config.json through the real huggingface_hub client,
read from a cache laid out as the client writes it, offline — no test reaches the network.

The cache (fixture ``hf_cache``) is what ``hf_hub_download`` leaves behind:
``hub/models--ORG--NAME/refs/<branch>`` holding a commit sha (no newline: the client reads the
file as it is, ``file_download.py`` ``_hf_hub_download_to_cache_dir``) and
``hub/models--ORG--NAME/snapshots/<sha>/config.json``. The config files are in
tests/fixtures/hf_configs: Meta-Llama-3-8B's public config.json, and a two-layer Llama.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import memcalc
from memcalc.cli import main
from memcalc.core.errors import InvalidInputError, MissingPackageError, UnknownModelError
from memcalc.sources.resolve import resolve
from memcalc.stacks.transformers.hub import PROBE_TIMEOUT_S, HubError, HubProblem, HuggingFace, download_config

hub = pytest.importorskip("huggingface_hub")
pytest.importorskip("transformers")

CONFIGS = Path(__file__).parent / "fixtures" / "hf_configs"
TINY = "memcalc-test/tiny-llama"
LLAMA3 = "meta-llama/Meta-Llama-3-8B"
MAIN_SHA = "0123456789abcdef0123456789abcdef01234567"
DEV_SHA = "89abcdef0123456789abcdef0123456789abcdef"
LLAMA3_SHA = "62bd457b6fe961a42a631306577e622c83876cb6"
#: Meta-Llama-3-8B as released: 8.03 B parameters (untied embedding and LM head).
LLAMA3_PARAMETERS = 8_030_261_248


def _tiny(layers: int) -> dict[str, object]:
    config: dict[str, object] = json.loads((CONFIGS / "tiny-llama.json").read_text())
    config["num_hidden_layers"] = layers
    return config


def _tiny_parameters(layers: int) -> int:
    """The tiny Llama's count, worked out: hidden 64, MLP 128, 4 heads of 16, 2 k/v heads, vocab 1000."""
    attention = 64 * 64 + 2 * (64 * 32) + 64 * 64  # q, k, v (2 heads × 16), o
    mlp = 3 * 64 * 128  # gate, up, down
    norms = 2 * 64
    return layers * (attention + mlp + norms) + 64 + 2 * 1000 * 64  # final norm, embedding, LM head


def _add_repo(cache: Path, repo_id: str, refs: dict[str, str], snapshots: dict[str, dict[str, object]]) -> None:
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    for branch, sha in refs.items():
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / branch).write_text(sha)  # no newline, as the client writes it
    for sha, config in snapshots.items():
        (folder / "snapshots" / sha).mkdir(parents=True)
        (folder / "snapshots" / sha / "config.json").write_text(json.dumps(config))


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An HF_HOME holding two repositories, with HF_HUB_OFFLINE=1.

    huggingface_hub reads HF_HOME / HF_HUB_CACHE and HF_HUB_OFFLINE once, when it is imported
    (``constants.py``: ``HF_HUB_CACHE = ...``, ``HF_HUB_OFFLINE = _is_true(...)``), and at each
    call reads the *constants*: ``hf_hub_download`` takes ``constants.HF_HUB_CACHE`` and the
    HTTP layer refuses requests when ``constants.is_offline_mode()``. Setting the environment
    alone would come too late in a test process, so the constants are patched too (the
    environment as well: memcalc reads HF_HUB_OFFLINE at each call).
    """
    cache = tmp_path / "hf_home" / "hub"
    _add_repo(cache, TINY, {"main": MAIN_SHA, "dev": DEV_SHA}, {MAIN_SHA: _tiny(2), DEV_SHA: _tiny(4)})
    _add_repo(cache, LLAMA3, {"main": LLAMA3_SHA},
              {LLAMA3_SHA: json.loads((CONFIGS / "meta-llama-3-8b.json").read_text())})
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)
    return cache


@dataclass
class FakeNetwork:
    """The Hub client's network in a test: every request fails as on a machine whose DNS
    fails (``[Errno -2] Name or service not known``, what this machine's real client says)
    unless ``respond`` answers it. ``requests``: every request the client made."""

    library: ModuleType  # the client's HTTP library (httpx2 in huggingface_hub 2.x)
    requests: list[Any] = field(default_factory=list)
    respond: Callable[[Any], Any] | None = None

    def handle(self, request: Any) -> Any:
        self.requests.append(request)
        if self.respond is None:
            raise self.library.ConnectError("[Errno -2] Name or service not known", request=request)
        return self.respond(request)

    def config_heads(self) -> list[Any]:
        """The requests for a config.json (the client also fetches a registry of its own)."""
        return [r for r in self.requests if r.method == "HEAD" and r.url.path.endswith("/config.json")]


@pytest.fixture(autouse=True)
def network(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNetwork]:
    """No test reaches the network: the client's shared HTTP client (``get_session``, which every
    request of huggingface_hub goes through) is replaced by one whose transport is a
    :class:`FakeNetwork` — the layer under both memcalc's probe and ``hf_hub_download``."""
    library = sys.modules[type(hub.get_session()).__module__.split(".")[0]]
    if not hasattr(library, "MockTransport"):  # a client on requests (huggingface_hub 0.x)
        pytest.skip("the client's HTTP library has no mock transport")
    fake = FakeNetwork(library)
    http = importlib.import_module("huggingface_hub.utils._http")
    monkeypatch.setattr(http, "_GLOBAL_CLIENT_FACTORY",
                        lambda: library.Client(transport=library.MockTransport(fake.handle)))
    hub.close_session()  # the next request makes its client with the factory above
    yield fake
    hub.close_session()


@pytest.fixture
def online(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HUB_OFFLINE unset and an empty cache: the Hub is asked (the :func:`network` fixture answers)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(tmp_path))
    return tmp_path


def _layers(spec: object) -> int:
    return int(resolve(spec, batch_size=1, seq_len=16).module.config.num_hidden_layers)


# ---- ids and revisions, offline --------------------------------------------------------------
def test_hub_id_resolves_offline_from_the_cache(hf_cache: Path) -> None:
    resolved = resolve(f"hf:{TINY}", batch_size=2, seq_len=16)
    assert resolved.name == f"hf:{TINY}"
    assert sum(p.numel() for p in resolved.module.parameters()) == _tiny_parameters(2)
    assert all(p.device.type == "meta" for p in resolved.module.parameters())
    # float32 parameters although config.json says torch_dtype bfloat16: --precision decides
    assert {p.dtype for p in resolved.module.parameters()} == {torch.float32}


def test_revision_by_commit_sha_and_by_branch(hf_cache: Path) -> None:
    assert _layers(f"hf:{TINY}@{DEV_SHA}") == 4
    assert _layers(f"hf:{TINY}@dev") == 4
    assert _layers(f"hf:{TINY}@main") == 2
    assert _layers(HuggingFace(TINY, revision="dev")) == 4
    assert HuggingFace(f"{TINY}@dev") == HuggingFace(f"hf:{TINY}", "dev") == HuggingFace(TINY, "dev")
    for bad in ("", "@main", f"{TINY}@", " x"):
        with pytest.raises(InvalidInputError):
            HuggingFace(bad)


def test_only_config_json_is_fetched(hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    real = hub.hf_hub_download

    def recording(repo_id: str, filename: str, **kwargs: object) -> str:
        asked.append(filename)
        return str(real(repo_id, filename, **kwargs))

    monkeypatch.setattr(hub, "hf_hub_download", recording)
    resolve(f"hf:{LLAMA3}", batch_size=1, seq_len=16)
    assert asked == ["config.json"]


def test_the_token_is_the_clients_own(hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # memcalc passes no token: the client takes HF_TOKEN (or the saved login) at each call
    monkeypatch.setenv("HF_TOKEN", "hf_memcalc_test_token")
    seen: list[object] = []
    real = hub.hf_hub_download

    def recording(repo_id: str, filename: str, **kwargs: object) -> str:
        seen.append(kwargs.get("token"))
        return str(real(repo_id, filename, **kwargs))

    monkeypatch.setattr(hub, "hf_hub_download", recording)
    download_config(TINY)
    assert seen == [None] and hub.get_token() == "hf_memcalc_test_token"


def test_missing_repository_offline_says_so(hf_cache: Path) -> None:
    with pytest.raises(HubError) as caught:
        resolve("hf:nobody/no-such-model", batch_size=1)
    error = caught.value
    assert error.problem is HubProblem.NOT_CACHED_OFFLINE
    assert error.args[0] == (f"nobody/no-such-model is not in the Hugging Face cache ({hf_cache}) "
                             f"and HF_HUB_OFFLINE is set")
    assert "HF_HUB_OFFLINE" in (error.hint or "")


@pytest.mark.parametrize("revision", ["no-such-branch", "f" * 40])
def test_missing_revision_offline_says_so(hf_cache: Path, revision: str) -> None:
    with pytest.raises(HubError) as caught:
        resolve(f"hf:{TINY}@{revision}", batch_size=1)
    assert caught.value.problem is HubProblem.REVISION_NOT_CACHED_OFFLINE
    assert f"revision {revision!r} of {TINY}" in caught.value.args[0]
    assert "\n" not in caught.value.args[0]


def test_meta_llama_3_8b_has_its_released_parameter_count(hf_cache: Path) -> None:
    resolved = resolve(f"hf:{LLAMA3}", batch_size=1, seq_len=16)
    assert sum(p.numel() for p in resolved.module.parameters()) == LLAMA3_PARAMETERS
    assert type(resolved.module).__name__ == "LlamaForCausalLM"


# ---- the client's errors -----------------------------------------------------------------------
def _http_error(cls: type, status: int) -> Exception:
    # HfHubHTTPError reads only these attributes of the response (huggingface_hub/errors.py)
    response = SimpleNamespace(headers={}, request=None, status_code=status)
    return cls("the Hub said no", response=response)


@pytest.mark.parametrize("make, problem, words", [
    (lambda e: _http_error(e.GatedRepoError, 403), HubProblem.GATED, ["gated", "hf auth login", "HF_TOKEN"]),
    (lambda e: _http_error(e.RepositoryNotFoundError, 404), HubProblem.NOT_FOUND, ["no Hugging Face repository",
                                                                                 "private", "hf auth login"]),
    (lambda e: _http_error(e.RevisionNotFoundError, 404), HubProblem.REVISION_NOT_FOUND, ["has no revision 'v9'"]),
    (lambda e: _http_error(e.RemoteEntryNotFoundError, 404), HubProblem.NO_CONFIG, ["has no config.json"]),
    (lambda e: _http_error(e.HfHubHTTPError, 401), HubProblem.UNAUTHORIZED, ["refused the token", "HF_TOKEN"]),
    (lambda e: e.LocalEntryNotFoundError("connection error"), HubProblem.NO_NETWORK, ["cannot reach"]),
])
def test_client_errors_become_one_line_messages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, make, problem,
                                                words) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(tmp_path))

    def failing(*args: object, **kwargs: object) -> str:
        raise make(hub.errors)

    monkeypatch.setattr(hub, "hf_hub_download", failing)
    with pytest.raises(HubError) as caught:
        download_config("some-org/some-model", "v9")
    error = caught.value
    assert error.problem is problem
    assert "\n" not in error.args[0] and error.hint
    text = str(error)
    for word in words:
        assert word in text, (word, text)


def test_gated_repository_on_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def gated(*args: object, **kwargs: object) -> str:
        raise _http_error(hub.errors.GatedRepoError, 403)

    monkeypatch.setattr(hub, "hf_hub_download", gated)
    result = CliRunner().invoke(main, [f"hf:{LLAMA3}", "--seq-len", "16"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines[0] == f"error: {LLAMA3} is a gated repository: its config.json needs an account with access"
    assert "Traceback" not in result.output and "hf auth login" in lines[1]


def test_a_bad_id_is_bad_input() -> None:
    with pytest.raises(InvalidInputError, match="not a Hugging Face Hub id"):
        download_config("a/b/c")


# ---- no network: one request, then the cache ---------------------------------------------------
NO_DNS = "ConnectError: [Errno -2] Name or service not known"


@pytest.mark.parametrize("failure", ["ConnectError", "ConnectTimeout", "ReadTimeout"])
def test_no_network_fails_within_seconds_with_the_clear_error(online: Path, network: FakeNetwork,
                                                             failure: str) -> None:
    # huggingface_hub alone retries five times after its first request (1+2+4+8+8 s of sleep):
    # 25 s before the same error. memcalc asks once, with a short timeout, then reads the cache.
    def fail(request: Any) -> Any:
        raise getattr(network.library, failure)("no answer", request=request)

    network.respond = None if failure == "ConnectError" else fail
    start = time.monotonic()
    with pytest.raises(HubError) as caught:
        download_config("meta-llama/Llama-3.1-8B")
    elapsed = time.monotonic() - start
    assert elapsed < 3.0, f"{elapsed:.1f} s"
    error = caught.value
    assert error.problem is HubProblem.NO_NETWORK
    why = NO_DNS if failure == "ConnectError" else f"{failure}: no answer"
    assert error.args[0] == (f"cannot reach the Hugging Face Hub ({why}), and meta-llama/Llama-3.1-8B is not "
                             f"in the cache ({online})")
    heads = network.config_heads()
    assert len(heads) == 1  # no retry
    assert heads[0].extensions["timeout"]["read"] == PROBE_TIMEOUT_S


def test_the_probe_waits_as_long_as_the_user_asked(online: Path, network: FakeNetwork,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub.constants, "HF_HUB_ETAG_TIMEOUT", 30)  # HF_HUB_ETAG_TIMEOUT=30: a slow link
    with pytest.raises(HubError):
        download_config("meta-llama/Llama-3.1-8B")
    assert [r.extensions["timeout"]["connect"] for r in network.config_heads()] == [30]


def test_no_network_still_answers_from_the_cache(hf_cache: Path, network: FakeNetwork,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)
    assert _layers(f"hf:{TINY}@dev") == 4
    assert len(network.config_heads()) == 1


def test_a_hub_that_answers_is_left_to_the_client(online: Path, network: FakeNetwork) -> None:
    # the probe's answer is an HTTP error: hf_hub_download asks again and says what it is, as before
    network.respond = lambda request: network.library.Response(
        404, headers={"X-Error-Code": "RepoNotFound"}, request=request)
    with pytest.raises(HubError) as caught:
        download_config("nobody/no-such-model")
    assert caught.value.problem is HubProblem.NOT_FOUND and caught.value.exit_code == 2
    assert len(network.config_heads()) == 2  # the probe's, the client's


def test_no_network_on_the_command_line(online: Path, network: FakeNetwork) -> None:
    start = time.monotonic()
    result = CliRunner().invoke(main, ["hf:meta-llama/Llama-3.1-8B", "--batch", "1", "--seq-len", "128"])
    assert time.monotonic() - start < 3.0
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines[0] == (f"error: cannot reach the Hugging Face Hub ({NO_DNS}), and meta-llama/Llama-3.1-8B "
                        f"is not in the cache ({online})")
    assert lines[1].startswith("Check the network connection") and "Traceback" not in result.output


# ---- the other hf: forms keep working, and never ask the Hub --------------------------------------
@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(*args: object, **kwargs: object) -> str:
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(hub, "hf_hub_download", unreachable)


def test_model_types_local_files_and_folders_stay_local(no_hub: None, tmp_path: Path) -> None:
    assert type(resolve("hf:gpt2", batch_size=1, seq_len=16).module).__name__ == "GPT2LMHeadModel"
    assert _layers(f"hf:{CONFIGS / 'tiny-llama.json'}") == 2
    folder = tmp_path / "saved-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_tiny(3)))
    assert _layers(f"hf:{folder}") == 3
    with pytest.raises(InvalidInputError, match="applies to Hub ids"):
        resolve(f"hf:{folder}@main", batch_size=1)


def test_a_bare_unknown_name_suggests_the_hub_form(no_hub: None) -> None:
    with pytest.raises(UnknownModelError) as caught:
        resolve("hf:lama", batch_size=1)
    assert "hf:llama" in str(caught.value) and "ORG/NAME" in str(caught.value)


@pytest.mark.parametrize("package", ["huggingface_hub", "transformers"])
def test_missing_packages_name_the_hf_extra(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
    with pytest.raises(MissingPackageError) as caught:
        resolve(f"hf:{TINY}", batch_size=1)
    assert caught.value.package == package
    assert "pip install 'memcalc[hf]'" in str(caught.value)


# ---- end to end ------------------------------------------------------------------------------
def test_estimate_of_a_hub_id(hf_cache: Path) -> None:
    report = memcalc.estimate(f"hf:{TINY}", batch_size=1, seq_len=32, gpu="a100-40gb")
    parameters = _tiny_parameters(2)
    assert report.model == f"hf:{TINY}" and report.parameters == parameters
    # Adam in fp32 keeps weights, gradients and two moments: 16 bytes per parameter at least
    assert report.bytes.peak_allocated >= 16 * parameters
    assert report.fits is True
    same = memcalc.estimate(HuggingFace(TINY), batch_size=1, seq_len=32, gpu="a100-40gb")
    assert same.bytes.peak_allocated == report.bytes.peak_allocated


def test_command_line_estimate_of_a_hub_id(hf_cache: Path) -> None:
    result = CliRunner().invoke(main, [f"hf:{TINY}@dev", "--seq-len", "32", "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["model"] == f"hf:{TINY}@dev" and data["parameters"] == _tiny_parameters(4)
    missing = CliRunner().invoke(main, ["hf:nobody/no-such-model", "--seq-len", "32"])
    assert missing.exit_code == 1
    assert missing.output.startswith("error: nobody/no-such-model is not in the Hugging Face cache")



@pytest.mark.parametrize("repo, change, says", [
    ("memcalc-test/zero-heads", {"num_attention_heads": 0}, "num_attention_heads must be at least 1, got 0"),
    ("memcalc-test/no-such-class", {"architectures": ["LlamaForCasualLM"]},
     "architectures names 'LlamaForCasualLM', a class the installed transformers does not have; did you mean "
     "'LlamaForCausalLM'?"),
])
def test_a_hub_config_transformers_cannot_build_is_refused_naming_the_field(hf_cache: Path, repo: str,
                                                                           change: dict[str, object], says: str):
    # issue 32: num_attention_heads 0 ended in transformers' ZeroDivisionError, architectures naming a
    # class transformers lacks in a silent LlamaForCausalLM
    _add_repo(hf_cache, repo, {"main": MAIN_SHA}, {MAIN_SHA: {**_tiny(2), **change}})
    with pytest.raises(InvalidInputError) as caught:
        memcalc.estimate(f"hf:{repo}", batch_size=1, seq_len=8)
    assert str(caught.value).startswith(f"transformers cannot build the config of hf:{repo}: {says}"), caught.value
