"""SIGKILL the coordinator of a GPU node mid-run (two EP ranks: two GPUs, or two workers sharing one)
and check that the workers rescue the iteration it left half filled, serve on, and match the
reference. If the node stalls for 20 s, every worker's threads are dumped (SIGUSR1) and it exits 3.

    python benchmarks/gpu_coordinator_kill.py > coordinator_kill.log
"""

import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "operator"), str(ROOT / "tests")]

def main() -> None:
    from runtime_support import TINY_DEEPSEEK_SPEC as SPEC
    from test_reliability_runtime import _setup
    from vexpert_runtime.model.checkpoint import write_tiny_checkpoint
    from vexpert_runtime.node import NodeOptions, NodeRuntime
    from vexpert_runtime.simulation.workload import drifting_workload
    tmp = Path(tempfile.mkdtemp())
    write_tiny_checkpoint(tmp, SPEC, seed=9)
    setup = _setup(tmp, timeout_s=15.0, device="cuda")
    workload = drifting_workload((("decode_in1000out1000", 6), ("prefill_in4096", 6)), SPEC.num_layers, SPEC.num_experts, tokens_per_worker=16, seed=4)
    box, ev = [], {}
    last = [time.monotonic(), 0]
    def progress(p):
        last[0], last[1] = time.monotonic(), p.iteration
        rt = box[0]
        pid = rt.coordinator_pid
        if "killed" not in ev and p.iteration >= 8 and pid is not None:
            ev["killed"] = p.iteration
            print("killing", pid, "at", p.iteration, flush=True)
            os.kill(pid, signal.SIGKILL)
        if p.iteration >= 60:
            rt.request_stop()
    def watch():
        while True:
            time.sleep(1)
            if "killed" in ev and time.monotonic() - last[0] > 20:
                print("STALLED at", last[1], "dumping workers", flush=True)
                for e in Path("/proc").iterdir():
                    if e.name.isdigit():
                        try:
                            if b"vexpert_runtime" in (e / "cmdline").read_bytes() or int((e/"stat").read_text().split()[3]) == os.getpid():
                                os.kill(int(e.name), signal.SIGUSR1)
                        except Exception:
                            pass
                time.sleep(3)
                print("state", box[0]._shared.state if box[0]._shared is not None else None, flush=True)
                os._exit(3)
    threading.Thread(target=watch, daemon=True).start()
    rt = NodeRuntime(setup, NodeOptions(workload=workload, iterations=5000, verify=True, fill_restart_delay_s=0.5, progress=progress, log=lambda line: print("LOG", line, flush=True)))
    box.append(rt)
    rep = rt.run()
    print("OK iterations", rep.iterations, "max err", rep.max_rel_error, "degraded", rep.degraded_groups, flush=True)

if __name__ == "__main__":
    main()
