"""Real JAX multi-controller runs on loopback: a launcher for tests and the worker it starts.

`launch(scenario, num_processes)` starts `num_processes` Python processes on
this machine, each with `DEVICES_PER_PROCESS` simulated CPU devices, joined
by `jax.distributed.initialize` at 127.0.0.1 on a free port, with gloo CPU
collectives. Each runs `scenario(ctx)` from `tests/multihost_scenarios.py`;
process 0's return value (a dict of NumPy arrays and plain values) comes back
to the test. Bounded: every child has a timeout and is killed when the
launch ends, whatever happened; only loopback addresses are used.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

DEVICES_PER_PROCESS = 2
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class Result:
    """What process 0 returned, and every process's output."""

    value: dict
    logs: list[str]


def launch(scenario: str, num_processes: int, timeout: float = 120.0, **kwargs) -> Result:
    """Runs `scenario` in `num_processes` joined processes; raises with their logs if any fails."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        argument = Path(tmp) / "kwargs.pkl"
        argument.write_bytes(pickle.dumps(kwargs))
        outputs = [Path(tmp) / f"out{i}.pkl" for i in range(num_processes)]
        logs = [Path(tmp) / f"log{i}.txt" for i in range(num_processes)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
        # The parent's XLA_FLAGS (the suite's compile settings, conftest.py), then this run's device count.
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
        env["XLA_FLAGS"] = flags.strip()
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        children = []
        try:
            for i in range(num_processes):
                command = [sys.executable, "-m", "tests.multihost", scenario, str(i), str(num_processes), str(port),
                           str(argument), str(outputs[i])]
                with open(logs[i], "w") as log:
                    children.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
            codes = []
            for child in children:
                try:
                    codes.append(child.wait(timeout=timeout))
                except subprocess.TimeoutExpired:
                    codes.append("timeout")
                    break
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
        texts = [log.read_text() if log.exists() else "" for log in logs]
        if any(code != 0 for code in codes) or len(codes) < num_processes:
            report = "\n".join(f"--- process {i} (exit {c}):\n{t[-4000:]}" for i, (c, t) in enumerate(zip(codes, texts)))
            raise AssertionError(f"multi-process scenario {scenario!r} failed:\n{report}")
        return Result(pickle.loads(outputs[0].read_bytes()), texts)


@dataclasses.dataclass
class Context:
    """What a scenario gets in each process."""

    process_index: int
    num_processes: int
    kwargs: dict


def _worker(scenario: str, process_index: int, num_processes: int, port: int, argument: str, output: str):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_index, initialization_timeout=60
    )
    from jaxtyping import install_import_hook

    with install_import_hook("kvattn", "beartype.beartype"):
        import kvattn  # noqa: F401
    from tests import multihost_scenarios

    kwargs = pickle.loads(Path(argument).read_bytes())
    value = getattr(multihost_scenarios, scenario)(Context(process_index, num_processes, kwargs))
    Path(output).write_bytes(pickle.dumps(value))
    jax.distributed.shutdown()


if __name__ == "__main__":
    name, index, count, port_number, argument_path, output_path = sys.argv[1:]
    _worker(name, int(index), int(count), int(port_number), argument_path, output_path)
