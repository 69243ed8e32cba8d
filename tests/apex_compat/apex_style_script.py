"""An apex-style training script, unchanged from what apex users write (run by test_compat.py through
``python -m fp16kit run``). Usage: apex_style_script.py OUT_FILE [STEPS]; RANK/WORLD_SIZE/MASTER_* from the env."""

import os
import sys

import torch
import torch.distributed as dist

try:
    from apex import amp
    from apex.optimizers import FusedAdam
    from apex.parallel import DistributedDataParallel as DDP
except ImportError:
    amp = None

assert __name__ == "__main__"
out_file = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
if amp is None:
    print("apex not found")
    sys.exit(5)

world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
if world > 1:
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
optimizer = FusedAdam(model.parameters(), lr=1e-2)
model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
if world > 1:
    model = DDP(model, delay_allreduce=True)
losses = []
for _ in range(steps):
    g = torch.Generator().manual_seed(100)
    x = torch.randn(32, 8, generator=g)
    y = x[:, :4].sum(1, keepdim=True).expand(32, 4)
    share = 32 // world
    x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    losses.append(loss.item())
torch.save({"losses": losses, "masters": [p.detach().clone() for p in amp.master_params(optimizer)],
            "scale": amp._amp_state.loss_scalers[0].loss_scale()}, out_file)
if world > 1:
    dist.destroy_process_group()
sys.exit(7)
