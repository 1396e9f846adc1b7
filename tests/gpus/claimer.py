"""One job's GPU step alone, for tests/gpus/test_claims.py: ``acquire.acquire`` (what ``make_plan`` runs before
anything else) with tests/fake_gpus first on PATH, then one JSON line on stdout ({"gpus": [...]} or {"error": ...,
"code": N}), then the claims held until stdin closes (``--hold``). Cheap: no torch, no training.

Run: PATH=tests/fake_gpus:$PATH python tests/gpus/claimer.py --gpus auto:2 --hold
"""

import argparse
import json
import os
import sys
import time

from ignite_mgpu.config.schema import DistConfig
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.gpus import acquire


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", required=True)
    parser.add_argument("--wait", type=float)
    parser.add_argument("--hold", action="store_true", help="hold the claims until stdin closes")
    parser.add_argument("--go", help="a barrier: print ready, then start once this file exists")
    parser.add_argument("--poll", type=float, default=0.05, help="seconds between two looks while waiting")
    args = parser.parse_args()
    acquire.POLL = args.poll
    if args.go:
        print(json.dumps({"ready": True}), flush=True)
        while not os.path.exists(args.go):
            time.sleep(0.0005)
    try:
        plan, held = acquire.acquire(DistConfig(gpus=args.gpus, wait=args.wait), os.environ)
    except ConfigError as err:
        print(json.dumps({"error": str(err), "code": err.exit_code}), flush=True)
        return err.exit_code
    print(json.dumps({"gpus": plan.physical_ids, "claimed": held.names, "at": time.time()}), flush=True)
    if args.hold:
        sys.stdin.read()
    held.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
