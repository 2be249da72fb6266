"""A tiny script the tests launch under each launcher: join the group through ddp_common.setup,
all-reduce the ranks, and print what this process learned as one JSON line."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ddp_common import cleanup, setup  # noqa: E402

ddp = setup()
total = torch.tensor([float(ddp.rank)])
dist.all_reduce(total)
record = json.dumps(
    {
        "rank": ddp.rank,
        "local_rank": ddp.local_rank,
        "world_size": ddp.world_size,
        "backend": ddp.backend,
        "device": str(ddp.device),
        "rank_sum": total.item(),
        "threads": torch.get_num_threads(),
    }
)
# One write of the whole line: print() writes the text and the newline separately, and the ranks
# share one stdout, so two ranks' lines could interleave into one.
os.write(1, (record + "\n").encode())
cleanup()
