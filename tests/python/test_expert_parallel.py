"""Expert parallelism from PyTorch: R processes on the one GPU through torchrun, each rank checked bit
for bit against one rank holding everything (tests/python/ep_worker.py)."""

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)


@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_equal_one_rank_bit_for_bit(ranks):
    worker = os.path.join(os.path.dirname(__file__), "ep_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", worker]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    passed = "\n".join(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert done.returncode == 0, f"checks passed:\n{passed}\n...\n{done.stderr[-5000:]}"
    for r in range(ranks):
        assert f"rank {r}/{ranks} nn.MoE" in passed, passed
        assert f"rank {r}/{ranks} fewer tokens" in passed, passed
        assert f"rank {r}/{ranks} fp8_block" in passed, passed
        assert f"rank {r}/{ranks} three forwards in flight" in passed, passed
        assert f"rank {r}/{ranks} contexts recomputed" in passed, passed
        assert f"rank {r}/{ranks} torch.compile" in passed, passed
        assert f"rank {r}/{ranks} two layers fp8_block" in passed, passed
