"""Know before you queue: per-device memory and step time of a config, before any launch.

    estimate = estimate_run(ctx)          # ctx: a pan.preflight.Preflight (job + planned layout)

Memory, per device, by category. The static ones are counted from the parameters and the layout:
parameters (fp32 master weights of the trained ones; frozen ones, a LoRA part's base, once at their
dtype), gradients, optimizer states (AdamW 8 B, Muon 4 B per parameter,
as `pan.estimate.probe.state_bytes` counts them for checkpoints) and the EMA, each divided by the FSDP
shard degree (dp_shard x cp; hybrid shard: the ranks of one node; ddp: 1); under FSDP also the
all-gathered working set (the block being computed and the one prefetched, in the compute dtype,
plus one block's unsharded gradients, plus the root module's own parameters). Frozen encoders
(text encoder, VAE) count where they are loaded (cp rank 0 of each group; a text encoder only when
the recipe encodes captions online), in their frozen dtype; the data loader's decoded samples in
flight count in host memory.

Activations and the attention workspace are not guessed from formulas: one training step of the
recipe's largest micro-batch (the most tokens the data budget lets a rank hold, captions at their
longest) is traced on fake tensors (`torch._subclasses.FakeTensorMode`: shapes only, no memory,
no FLOPs), with the run's activation checkpointing applied to a copy of the model and Ulysses'
exchanges simulated for cp > 1. Every tensor the step creates is followed from its allocation to
its release, so the trace's peak is the step's: saved activations, recomputed blocks, backward
temporaries and the gradients as they appear (divided by the shard degree, as FSDP's
reduce-scatter leaves them). Each recipe says what only it knows, its largest micro-batch and how
its step runs (its Recipe's `probe` hook).

Step time: the same trace counts the work of every operation: matmul and convolution FLOPs,
attention FLOPs, and the bytes every other (memory-bound) operation reads and writes, for the
forward, the backward, recomputation and the optimizer step. Each class is timed with a rate
measured on the spot on this machine's device (a matmul of the step's own largest GEMM shape, its
main convolution shapes, an attention call of its longest segment, an elementwise pass over a
large tensor). With several ranks the step also communicates (`step_traffic`): FSDP's all-gathers
of every unit (forward and backward) and reduce-scatters of the gradients (all-reduces over HSDP's
or ddp's replicas), Muon's exchanges of sharded matrices, Ulysses' all-to-alls (counted where the
trace simulates them, again in a fully checkpointed block's recomputation) and a few scalar sums.
Each kind costs its calls times a fixed cost per call plus its bytes over a bandwidth: gloo's on
the CPU, measured on the spot between two threads; NCCL's on GPUs, from datasheet figures
(`measure_network`). A process keeps the rates of each set of shapes and the network (`rates_for`,
`network_of_this_machine`); each traced step is kept in the process and on disk ($PAN_CACHE_DIR,
else ~/.cache/pan; `cached_trace_step`): `pan check` of many configs traces a step once, and
train.py's start-up checks reuse the trace of the `pan check` run before it. Tokens per second, the run's wall time and GPU-hours follow
from max_steps. The recipe's exact FLOP count (its
`forward_flops`) is reported beside it, with the MFU it implies.
"""

from pan.estimate.cost import measure_network, measure_rates, step_clock, with_network
from pan.estimate.probe import (
                                FP32_BYTES,
                                Phase,
                                Probe,
                                frozen_vae_bytes,
                                hf_model_bytes,
                                largest_batch,
                                loader_bytes,
                                module_bytes,
                                probe_of,
                                run_device,
                                state_bytes,
)
from pan.estimate.run import estimate_run, fitting_changes

# The names other modules import from pan.estimate (recipes' probes, pan.preflight, the tests).
__all__ = ["FP32_BYTES", "Phase", "Probe", "estimate_run", "fitting_changes", "frozen_vae_bytes", "hf_model_bytes",
           "largest_batch", "loader_bytes", "measure_network", "measure_rates", "module_bytes", "probe_of",
           "run_device", "state_bytes", "step_clock", "with_network"]
