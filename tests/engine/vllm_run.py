"""Runs inside the engine environment (vLLM installed): one vLLM engine, one case, results as JSON.

    python vllm_run.py generate SPEC.json OUT.json     # greedy tokens and logprobs of PROMPTS
    python vllm_run.py state-dict SPEC.json OUT.json   # the state dict vLLM builds per rank, before loading
    python vllm_run.py state-values SPEC.json OUT.json # every rank's state after vLLM's own loader filled it
                                                       # (load_format "auto", or "sharded_state")
    python vllm_run.py serve                           # the cases above, one per line of stdin (see serve)

The engine environment also lists :func:`register_probe` as a ``vllm.general_plugins`` entry point,
so every vLLM process (workers included) knows the probe's load format.

SPEC holds ``model``, ``load_format``, ``tp``, ``pp`` and ``ep`` (optional, 1), ``extra``
(model_loader_extra_config, optional), ``prompts`` and ``max_tokens``. Nothing here imports the test
suite: it runs in another environment.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _engine(spec: dict[str, Any], load_format: str | None = None) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if spec.get("extra") is not None:
        kwargs["model_loader_extra_config"] = spec["extra"]
    if spec.get("pp", 1) > 1:
        kwargs |= {"pipeline_parallel_size": spec["pp"], "distributed_executor_backend": "mp"}
    if spec.get("ep", 1) > 1:
        kwargs["enable_expert_parallel"] = True
    return LLM(
        model=spec["model"],
        load_format=load_format or spec["load_format"],
        tensor_parallel_size=spec["tp"],
        dtype="bfloat16",
        max_model_len=256,
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        seed=0,
        **kwargs,
    )


def generate(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    start = time.perf_counter()
    llm = _engine(spec)
    ready = time.perf_counter() - start
    # Every prompt runs to max_tokens: a tiny random model may pick its end-of-sequence token early.
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=1, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    cases = []
    for o in outputs:
        c = o.outputs[0]
        cases.append(
            {"tokens": list(c.token_ids), "logprobs": [step[tok].logprob for tok, step in zip(c.token_ids, c.logprobs)]}
        )
    return {"engine_ready_s": ready, "outputs": cases}


PROBE_FORMAT = "state-dict-probe"
VALUES_FORMAT = "state-values-probe"
SHARDED_VALUES_FORMAT = "sharded-state-values-probe"
GDSLOAD_VALUES_FORMAT = "gdsload-state-values-probe"


def _global_rank() -> int:
    """This worker's global rank as gdsload numbers them: pipeline stage x tp + tensor-parallel rank."""
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_pp_group().rank_in_group * get_tensor_model_parallel_world_size() + get_tensor_model_parallel_rank()


def register_probe() -> None:
    """vLLM plugin (entry point of the engine environment): the probes' load formats.

    ``state-dict-probe``: each worker writes the state dict vLLM's sharded_state loader would fill (names,
    shapes, dtypes, after vLLM's own shared-tensor filter) to ``OUT/rank{R}.json`` and stops the engine.
    ``state-values-probe`` / ``sharded-state-values-probe`` / ``gdsload-state-values-probe``: vLLM's default loader
    (or sharded_state, or gdsload's load format) fills the state, which each worker writes to
    ``OUT/rank{R}.safetensors`` before stopping the engine.
    """
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    class StateDictProbe(BaseModelLoader):
        def __init__(self, load_config: Any):
            super().__init__(load_config)
            self.out = load_config.model_loader_extra_config["out"]

        def download_model(self, model_config: Any) -> None:
            pass

        def load_weights(self, model: Any, model_config: Any) -> None:
            kept = ShardedStateLoader._filter_subtensors(model.state_dict())
            found = {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in kept.items()}
            with open(f"{self.out}/rank{_global_rank()}.json", "w") as f:
                json.dump(found, f)
            raise RuntimeError("state-dict-probe: state dict written, engine stopped on purpose")

    register_model_loader(PROBE_FORMAT)(StateDictProbe)

    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    def values_probe(base: type, load_format: str) -> type:
        class StateValuesProbe(base):  # type: ignore[misc,valid-type]
            """vLLM's own loader (``base``); then each worker writes the state it filled, as vLLM's sharded_state
            keeps it (shared tensors filtered), to ``OUT/rank{global rank}.safetensors``, and stops the engine."""

            def __init__(self, load_config: Any):
                import dataclasses

                self.out = load_config.model_loader_extra_config["out"]
                super().__init__(
                    dataclasses.replace(load_config, load_format=load_format, model_loader_extra_config={})
                )

            def load_weights(self, model: Any, model_config: Any) -> None:
                from safetensors.torch import save_file

                super().load_weights(model, model_config)
                kept = ShardedStateLoader._filter_subtensors(model.state_dict())
                save_file(
                    {k: v.detach().contiguous().clone() for k, v in kept.items()},
                    f"{self.out}/rank{_global_rank()}.safetensors",
                )
                raise RuntimeError("state-values-probe: state written, engine stopped on purpose")

        return StateValuesProbe

    register_model_loader(VALUES_FORMAT)(values_probe(DefaultModelLoader, "auto"))
    register_model_loader(SHARDED_VALUES_FORMAT)(values_probe(ShardedStateLoader, "sharded_state"))
    from gdsload.loader.adapters.vllm import loader_class

    register_model_loader(GDSLOAD_VALUES_FORMAT)(values_probe(loader_class(), "gdsload"))


def state_dict(spec: dict[str, Any]) -> dict[str, Any]:
    """The state dict every worker's model holds before loading (see :func:`register_probe`)."""
    import glob
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        try:
            _engine({**spec, "extra": {"out": out}}, PROBE_FORMAT)
        except Exception:  # vLLM wraps the probe's stop; what counts is that every rank wrote its file
            pass
        ranks = {}
        for path in sorted(glob.glob(f"{out}/rank*.json")):
            with open(path) as f:
                ranks[path.rsplit("rank", 1)[1].removesuffix(".json")] = json.load(f)
    world = spec["tp"] * spec.get("pp", 1)
    if len(ranks) != world:
        raise SystemExit(f"state-dict-probe: {len(ranks)} of {world} ranks wrote their state dict")
    return {"state_dict": ranks}


def state_values(spec: dict[str, Any]) -> dict[str, Any]:
    """Every rank's state as vLLM's own loader fills it (see :func:`register_probe`), in ``spec["out"]``."""
    import glob

    out = spec["out"]
    fmt = {"sharded_state": SHARDED_VALUES_FORMAT, "gdsload": GDSLOAD_VALUES_FORMAT}.get(
        spec.get("load_format", "auto"), VALUES_FORMAT
    )
    try:
        _engine({**spec, "extra": {"out": out}}, fmt)
    except Exception:  # vLLM wraps the probe's stop; what counts is that every rank wrote its file
        pass
    world = spec["tp"] * spec.get("pp", 1)
    files = sorted(glob.glob(f"{out}/rank*.safetensors"))
    if len(files) != world:
        raise SystemExit(f"state-values-probe: {len(files)} of {world} ranks wrote their state")
    return {"files": files}


def run_case(mode: str, spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    result = {"generate": generate, "state-dict": state_dict, "state-values": state_values}[mode](spec)
    with open(out_path, "w") as f:
        json.dump(result, f)


def serve() -> None:
    """Run cases one after another, each in a process of its own forked from this one once vLLM is imported,
    so that no case pays for Python's import of vLLM (seconds) again. One JSON request per line of stdin:
    ``{"mode", "spec", "out", "log", "cwd", "env", "timeout"}``; one JSON answer per line of stdout:
    ``{"returncode"}``. The child runs as ``vllm_run.py MODE SPEC OUT`` would, in a new session (a timeout
    kills its workers too), its output in ``log``, its environment exactly ``env``. Nothing runs in this
    process but the import, so each child starts from the same state a fresh interpreter would reach."""
    import signal
    import traceback

    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setsid()
                null = os.open(os.devnull, os.O_RDONLY)  # the requests stay this process's to read
                os.dup2(null, 0)
                os.close(null)
                fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
                os.chdir(req["cwd"])
                os.environ.clear()
                os.environ.update(req["env"])
                run_case(req["mode"], req["spec"], req["out"])
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
                print(e, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + req["timeout"]
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                code = -9
                break
            time.sleep(0.05)
        try:  # workers the case left behind (its session) do not outlive it
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.stdout.write(json.dumps({"returncode": code}) + "\n")
        sys.stdout.flush()


def main() -> None:
    if sys.argv[1] == "serve":
        serve()
    else:
        run_case(*sys.argv[1:4])


if __name__ == "__main__":
    main()
