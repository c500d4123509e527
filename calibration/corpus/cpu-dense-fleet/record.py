#!/usr/bin/env python
"""How this case was recorded: two servers from server.yaml's flags, each bound to its own core
with one OpenMP thread, then ``simcap live validate --record`` over both (one server instance
pair per pass; the first pass also runs the calibration workload on the first server).

    python calibration/corpus/cpu-dense-fleet/record.py      # from the repository root
"""
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from simcap.live.launch import load_server_config, server_args
from simcap.live.server import VllmServer

D = "calibration/corpus/cpu-dense-fleet"
config, base = load_server_config(Path(D) / "server.yaml")
Path(".fleet").mkdir(exist_ok=True)
for instance in range(2):
    cores = sorted(os.sched_getaffinity(0))[:2]
    servers = [VllmServer(config.model_dir(base), extra_args=server_args(config, base, speculative=False),
                          served_model_name=config.served_model_name, startup_timeout=420,
                          kv_cache_gib=config.engine.kv_cache_gib, dtype=config.engine.dtype, eager=True,
                          log_path=f".fleet/s{i}-{instance}.log",
                          env={"VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1"})
               for i, core in enumerate(cores)]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(), servers))
        args = ["simcap", "live", "validate", f"{D}/poisson-2-replicas.yaml", "--repeats", "1",
                "--record", D, "--point", "poisson-2-replicas"]
        for i, s in enumerate(servers):
            args += ["--base-url", s.base_url, "--log", f".fleet/s{i}-{instance}.log"]
        if instance == 0:
            args += ["--calibrate-up-to", "2", "--roofline-hardware", f"{D}/hardware.yaml",
                     "--roofline-model", "tiny-llama-cpu", "--description",
                     "The tiny dense model on two vLLM CPU servers, each bound to one core with one OpenMP thread "
                     "(server.yaml's flags, VLLM_CPU_OMP_THREADS_BIND, OMP_NUM_THREADS=1), behind simcap's "
                     "least-request router, Poisson arrivals: fitted on the calibration workload at 1-2 clients "
                     "on the first server, predicting the fleet on two pairs of server instances.",
                     "--mechanism", "fleet of two replicas", "--mechanism", "router (least request)",
                     "--mechanism", "open loop"]
        print(" ".join(args), flush=True)
        subprocess.run(args, check=True)
    finally:
        for s in servers:
            s.stop()
