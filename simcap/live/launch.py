"""A server launch config (``--launch SERVER.yaml``): which vLLM server live mode starts itself.

One small YAML names the model, vLLM's engine flags and, optionally, the speculative config;
:func:`load_server_config` validates it (an unknown or bad key is one line naming it) and
:func:`launch_server` turns it into a :class:`~simcap.live.server.VllmServer`, with or without
its speculative config (the two arms of a live crossover)::

    model: tiny                     # tiny | tiny-moe (built by .ci/vllm-cpu-setup) | a model folder
    served_model_name: tiny
    engine:                         # vLLM's flags (vllm serve --NAME)
      max_num_seqs: 8
      max_num_batched_tokens: 512
      max_model_len: 2048
      block_size: 32
      enable_prefix_caching: true
      kv_cache_gib: 1               # VLLM_CPU_KVCACHE_SPACE
      dtype: bfloat16
      enforce_eager: true
    speculative:                    # --speculative-config, as vLLM's JSON
      method: ngram                 # ngram | eagle3 | eagle (these two need model: a draft head's
                                    # folder, or tiny-eagle3, built by .ci/vllm-cpu-setup)
      num_speculative_tokens: 3
      prompt_lookup_max: 4
      # rejection_sample_method: synthetic   # accepted drafts drawn at these rates (the drafter
      # synthetic_acceptance_rates: [0.56, 0.41, 0.30]   # still runs); or synthetic_acceptance_length
    startup_timeout_s: 420
    extra_args: []                  # any further vllm serve arguments, as given

A relative model (or draft model) folder is read from the YAML's folder. The server always
writes its per-step log (``--enable-logging-iteration-details``), which live calibration fits.

:func:`engine_mismatches` compares the config's flags with a scenario's engine section: a live
measurement of one configuration judged against a prediction of another answers nothing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from simcap.config.scenario import Scenario, format_validation_error
from simcap.config.yaml_files import read_yaml_mapping
from simcap.errors import ScenarioError
from simcap.live.server import VllmServer, tiny_eagle3_dir, tiny_model_dir, tiny_moe_model_dir

BUILT_MODELS = {"tiny": tiny_model_dir, "tiny-moe": tiny_moe_model_dir}
BUILT_DRAFTS = {"tiny-eagle3": tiny_eagle3_dir}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class LaunchEngine(_Strict):
    """vLLM's engine flags, named as ``vllm serve`` names them."""

    max_num_seqs: int = Field(8, gt=0)
    max_num_batched_tokens: int = Field(512, gt=0)
    max_model_len: int = Field(2048, gt=1)
    block_size: int = Field(32, gt=0)
    enable_prefix_caching: bool = True
    kv_cache_gib: int = Field(1, gt=0, description="VLLM_CPU_KVCACHE_SPACE: GiB of KV cache")
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    enforce_eager: bool = True


class LaunchSpeculative(_Strict):
    """vLLM's ``--speculative-config`` (written as its JSON)."""

    method: Literal["ngram", "eagle3", "eagle"]
    num_speculative_tokens: int = Field(ge=1, le=16)
    prompt_lookup_max: int | None = Field(None, ge=1)
    prompt_lookup_min: int | None = Field(None, ge=1)
    model: str | None = Field(
        None, description="EAGLE / EAGLE3: the draft head's folder, or tiny-eagle3 (built by .ci/vllm-cpu-setup)")
    rejection_sample_method: Literal["standard", "synthetic"] | None = Field(
        None, description="synthetic: which drafts are accepted is drawn at the rates below")
    synthetic_acceptance_length: float | None = Field(None, ge=1.0)
    synthetic_acceptance_rates: tuple[float, ...] | None = Field(
        None, description="unconditional per-position rates, non-increasing, one per draft")

    @model_validator(mode="after")
    def _method_keys(self) -> "LaunchSpeculative":
        self._synthetic_keys()
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative.model: ngram drafts from the prompt; allowed only for eagle, eagle3")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"speculative.prompt_lookup_min: must be <= prompt_lookup_max ({hi}) (got {lo})")
        else:
            if self.model is None:
                raise ValueError(f"speculative.model: {self.method} needs its draft head's folder")
            for key in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, key) is not None:
                    raise ValueError(f"speculative.{key}: allowed only for ngram (method is {self.method})")
        return self

    def _synthetic_keys(self) -> None:
        """vLLM's own checks of the synthetic keys, as one-line errors before a server starts."""
        length, rates, k = self.synthetic_acceptance_length, self.synthetic_acceptance_rates, self.num_speculative_tokens
        if self.rejection_sample_method != "synthetic":
            if length is not None or rates is not None:
                key = "synthetic_acceptance_length" if length is not None else "synthetic_acceptance_rates"
                raise ValueError(f"speculative.{key}: allowed only with rejection_sample_method: synthetic")
            return
        if (length is None) == (rates is None):
            raise ValueError("speculative.rejection_sample_method: synthetic needs exactly one of "
                             "synthetic_acceptance_length and synthetic_acceptance_rates")
        if length is not None and length > k + 1:
            raise ValueError(f"speculative.synthetic_acceptance_length: must be in [1, {k + 1}] "
                             f"(num_speculative_tokens + 1) (got {length:g})")
        if rates is not None:
            if len(rates) != k:
                raise ValueError(f"speculative.synthetic_acceptance_rates: must have {k} entries, one per "
                                 f"draft position (got {len(rates)})")
            if not all(0.0 <= r <= 1.0 for r in rates):
                raise ValueError(f"speculative.synthetic_acceptance_rates: entries must be in [0, 1] (got {list(rates)})")
            if any(b > a for a, b in zip(rates, rates[1:])):
                raise ValueError(f"speculative.synthetic_acceptance_rates: must be non-increasing (got {list(rates)})")


class ServerConfig(_Strict):
    """A launch config: model, engine flags, optional speculative config."""

    model: str = "tiny"
    served_model_name: str = Field("tiny", min_length=1)
    engine: LaunchEngine = LaunchEngine()
    speculative: LaunchSpeculative | None = None
    startup_timeout_s: float = Field(420.0, gt=0)
    extra_args: tuple[str, ...] = ()

    def model_dir(self, base_dir: Path) -> Path:
        built = BUILT_MODELS.get(self.model)
        return built() if built else (base_dir / self.model).resolve()

    def speculative_json(self, base_dir: Path) -> str | None:
        """``--speculative-config``'s value (None: no speculative config)."""
        if self.speculative is None:
            return None
        data = self.speculative.model_dump(exclude_none=True)
        if "model" in data:
            built = BUILT_DRAFTS.get(data["model"])
            data["model"] = str(built() if built else (base_dir / data["model"]).resolve())
        return json.dumps(data, separators=(",", ":"))


def parse_server_config(data: Any, where: str = "launch config") -> ServerConfig:
    """Validate a launch config given as a dict; errors are one line naming the key."""
    if not isinstance(data, dict):
        raise ScenarioError(f"{where}: expected a mapping (model, engine, speculative, ...)")
    try:
        return ServerConfig.model_validate_json(json.dumps(data), strict=True)
    except ValidationError as exc:
        raise ScenarioError(f"{where}: {format_validation_error(exc, ServerConfig)}") from None
    except (TypeError, ValueError) as exc:  # values JSON cannot carry (dates, ...)
        raise ScenarioError(f"{where}: {exc}") from None


def load_server_config(path: str | Path) -> tuple[ServerConfig, Path]:
    """Read ``SERVER.yaml``: the config and the folder relative paths in it start from."""
    path = Path(path)
    data, _ = read_yaml_mapping(path, "launch config", "keys (model, engine, speculative, ...)")
    return parse_server_config(data, str(path)), path.parent


def server_args(config: ServerConfig, base_dir: Path, *, speculative: bool = True) -> list[str]:
    """The ``vllm serve`` arguments of ``config`` beyond those :class:`VllmServer` adds."""
    eng = config.engine
    args = [
        "--max-num-seqs", str(eng.max_num_seqs),
        "--max-num-batched-tokens", str(eng.max_num_batched_tokens),
        "--max-model-len", str(eng.max_model_len),
        "--block-size", str(eng.block_size),
        "--enable-prefix-caching" if eng.enable_prefix_caching else "--no-enable-prefix-caching",
        "--enable-logging-iteration-details",
    ]  # fmt: skip
    spec = config.speculative_json(base_dir) if speculative else None
    if spec is not None:
        args += ["--speculative-config", spec]
    return args + list(config.extra_args)


def launch_server(
    config: ServerConfig | str | Path, base_dir: Path | None = None, *, speculative: bool = True,
    log_path: str | Path | None = None,
) -> VllmServer:
    """The (not yet started) server of a launch config; ``speculative=False``: without its
    speculative config (the baseline arm). ``config``: a :class:`ServerConfig` (relative
    paths from ``base_dir``) or the YAML's path."""
    if not isinstance(config, ServerConfig):
        config, base_dir = load_server_config(config)
    base = base_dir or Path.cwd()
    eng = config.engine
    return VllmServer(
        config.model_dir(base),
        extra_args=server_args(config, base, speculative=speculative),
        served_model_name=config.served_model_name,
        startup_timeout=config.startup_timeout_s,
        kv_cache_gib=eng.kv_cache_gib,
        dtype=eng.dtype,
        eager=eng.enforce_eager,
        log_path=log_path,
    )


def engine_mismatches(config: ServerConfig, scenario: Scenario) -> list[str]:
    """The engine flags on which the launch config and the scenario disagree, as
    ``"max_num_seqs: scenario 16, launch config 8"`` (empty: they agree)."""
    eng, sc = config.engine, scenario.engine
    out = [
        f"{key}: scenario {getattr(sc, key)}, launch config {getattr(eng, key)}"
        for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "enable_prefix_caching")
        if getattr(sc, key) != getattr(eng, key)
    ]
    spec, mine = scenario.speculative, config.speculative
    if spec is not None and mine is None:
        out.append(f"speculative: scenario {spec.method} k={spec.num_speculative_tokens}, launch config none")
    if spec is not None and mine is not None:
        for key in ("method", "num_speculative_tokens"):
            if getattr(spec, key) != getattr(mine, key):
                out.append(f"speculative.{key}: scenario {getattr(spec, key)}, launch config {getattr(mine, key)}")
    return out


_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b:")


def startup_failure_line(exc: Exception, lines: int = 3) -> str:
    """A server that failed to start, in one line: its exit code (or how long it was waited
    for), its log file and its last log lines -- the last exception lines when the log has
    any (the root cause sits above the shutdown chatter), else the last lines."""
    from simcap.live.server import VllmServerError

    if not isinstance(exc, VllmServerError) or exc.log_tail is None:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    head = str(exc).splitlines()[0].rstrip(":")  # names the exit code (or the wait) and the log
    tail = [line.strip() for line in exc.log_tail.splitlines() if line.strip()]
    errors = [line for line in tail if _ERROR_LINE.search(line)]
    return f"{head}; last log lines: " + " | ".join((errors or tail)[-lines:])
