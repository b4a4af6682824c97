"""Launch one generated kernel a few times for Nsight Compute (dev tool). Usage on the H200:

  ncu --clock-control none --kernel-name regex:_verify --launch-skip 4 --launch-count 4 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
      python3 benchmarks/ncu_probe.py --group 8 --batch 64 --prefix 16384 [--config '{"split": ...}']

The first two launches (one warm-up call = prefix + merge kernels) compile; ncu skips them.
"""

from __future__ import annotations

import argparse
import json

import torch

import kgen
from kgen.problems import make_case
from kgen.spec import load_layouts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="qwen3_5_gqa256")
    ap.add_argument("--kv", default="bfloat16")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=16384)
    ap.add_argument("--draft", type=int, default=4)
    ap.add_argument("--config", default=None, help="block config as JSON, merged over the table's")
    ap.add_argument("--launches", type=int, default=6)
    args = ap.parse_args()
    module = kgen.load(args.layout, args.kv)
    case = make_case(load_layouts()[args.layout], [args.prefix] * args.batch, [args.draft] * args.batch, args.group,
                     kv_dtype=args.kv, device="cuda", seed=1)
    config = None
    if args.config:
        arch = module.LAUNCHER.device_info("cuda", None)[0]
        config = {**module.select_config(arch, args.group, args.batch), **json.loads(args.config)}
    for _ in range(args.launches):
        module.launch(*case.launch_args(), config=config)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
