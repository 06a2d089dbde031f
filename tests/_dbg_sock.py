import os, socket, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
from tests.support.distributed_harness import run_distributed

def socket_fds():
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out[int(fd)] = target
    return out

def scenario(how):
    rank = dist.get_rank()
    before = socket_fds()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    created = {fd: t for fd, t in socket_fds().items() if before.get(fd) != t}
    started = time.monotonic()
    out = f"rank {rank} new sockets {len(created)}; "
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(4), group=group)
            out += "all_reduce returned?"
        except Exception as e:
            out += f"all_reduce raised after {time.monotonic() - started:.2f} s"
    else:
        work = dist.broadcast(torch.ones(8), src=1, group=group, async_op=True)
        work2 = dist.all_reduce(torch.ones(3), group=group, async_op=True)
        time.sleep(1.0)
        t = time.monotonic()
        if how == "shutdown":
            for fd in created:
                s = socket.socket(fileno=os.dup(fd))
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError as e:
                    out += f"[{fd}: {e}]"
                finally:
                    s.close()
        t2 = time.monotonic()
        dist.destroy_process_group(group)
        out += f"shutdown {t2 - t:.2f} s, destroy {time.monotonic() - t2:.2f} s"
    with open(f"/tmp/dbgsock_{how}_{os.getpid()}", "w") as f:
        f.write(out)
    time.sleep(3)
    os._exit(0)

if __name__ == "__main__":
    import glob
    for how in sys.argv[1:]:
        try:
            run_distributed(scenario, 2, how, timeout_s=40)
        except Exception as e:
            pass
        for p in glob.glob(f"/tmp/dbgsock_{how}_*"):
            print(how, open(p).read()); os.remove(p)
