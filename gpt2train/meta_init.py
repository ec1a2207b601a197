"""A sharded run's model built on the meta device and initialised as one process would (torchtitan builds on meta
and materialises after parallelize): build_on_meta() records the RNG state and every init call GPT() makes,
parallel.parallelize() splits the empty model (FSDP shards, tensor-parallel slices, a pipeline stage's modules), and
materialise() allocates each rank's part and replays the calls on one whole parameter at a time, each rank keeping
its part. No rank ever holds the whole model.
"""

import weakref

import torch
import torch.nn as nn

from gpt2train.tensor_parallel import model_rows
from model import GPT, rotary_cos_sin

# the models build_on_meta() made that materialise() has not filled yet: model -> (the RNG state GPT() started from,
# its init calls), or (None, []) where a sharded checkpoint will overwrite every weight
DEFERRED = weakref.WeakKeyDictionary()


class RecordInit(torch.overrides.TorchFunctionMode):
    """While a model is built on the meta device: every in-place call on one of its parameters (nn.init.normal_,
    kaiming_uniform_, Tensor.zero_, ...), in order, to be replayed on real tensors by materialise()."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = kwargs.get("tensor", args[0] if args else None)  # nn.init passes it by keyword
        name = getattr(func, "__name__", "")
        if isinstance(target, nn.Parameter) and name.endswith("_") and not name.startswith("__"):
            self.calls.append((target, func, args, kwargs))
        return func(*args, **kwargs)


def build_on_meta(config, replay=True):
    """GPT(config) with its parameters on the meta device (no memory); DEFERRED holds what materialise() needs to
    give it exactly the weights GPT(config) would have drawn here: the RNG state and every init call, in order.
    replay=False (a sharded checkpoint will overwrite every weight): materialise() only allocates."""
    if not replay:
        with torch.device("meta"):
            model = GPT(config)
        DEFERRED[model] = (None, [])
        return model
    rng = torch.get_rng_state()
    with torch.device("meta"), RecordInit() as record:
        model = GPT(config)
    # a tensor no longer in the model (wte's own weight, before tying) maps to None: its draws are replayed for the
    # RNG stream and dropped
    names = {id(p): n for n, p in model.named_parameters()}
    DEFERRED[model] = (rng, [(names.get(id(t)), t.shape, f, a, k) for t, f, a, k in record.calls])
    return model


def materialise(model, env):
    """Allocate a model built by build_on_meta() on `device` (a sharded one: only this rank's shards) and initialise
    it as GPT() would have from the same RNG state: each init call is replayed on a whole CPU tensor, one parameter
    at a time, and each rank keeps its slice (a pipeline stage: its own parameters, whole). Host memory: the shards
    plus the largest parameter. Afterwards the RNG is where GPT() would have left it; the rotary tables are
    recomputed. Built with replay=False: the shards are only allocated (a checkpoint's weights and RNG states come
    next), the RNG untouched."""
    rng, calls = DEFERRED.pop(model)
    model.to_empty(device=env.device)
    if model.config.tie_embeddings:  # to_empty gives each module its own tensor (FSDP keeps the tie, DTensor not)
        model.lm_head.weight = model.transformer.wte.weight
    params = dict(model.named_parameters(remove_duplicate=False))  # a pipeline stage's only
    if rng is not None:
        torch.set_rng_state(rng)
    with torch.no_grad():
        for name, shape, func, args, kwargs in calls:
            value = torch.empty(shape)
            if "tensor" in kwargs:
                func(*args, **{**kwargs, "tensor": value})
            else:
                func(value, *args[1:], **kwargs)
            if name in params:
                param = params[name]
                local_part(param).copy_(part_of(name, value, param, env))
            del value  # before the next one is allocated: one whole parameter at a time
        if model.config.rotary_pct is not None:
            for buffer, table in zip(
                (model.rope_cos, model.rope_sin),
                rotary_cos_sin(model.config.rot_dim, model.config.block_size, model.config.rotary_base),
            ):
                buffer.copy_(table)


def local_part(tensor):
    """What this rank holds of `tensor`: a DTensor's local shard, a plain (replicated) tensor itself."""
    from torch.distributed.tensor import DTensor  # here: its import costs ~1 s, and only split runs need it

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def part_of(name, whole, param, env):
    """This rank's part of `whole`, the values of parameter `name` in GPT-2's layout, as `param` holds it: FSDP's
    shard (local_slice), a tensor-parallel DTensor's slice (with FSDP's of it; tensor_parallel.model_rows), or a
    plain (replicated) parameter whole."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return whole
    if env.tensor_parallel == 1:  # the mesh is (replicate, shard) or (shard,), ranks laid out row-major
        return local_slice(whole, env.mesh_shape[-1], env.rank % env.mesh_shape[-1])
    return distribute_tensor(
        model_rows(name, whole, param), param.device_mesh, param.placements, src_data_rank=None
    ).to_local()


def local_slice(whole, shards, index):
    """Shard `index` of `whole` split over `shards` ranks as FSDP2 splits a parameter: torch.chunk along dim 0
    (trailing ranks of a short dim 0 get nothing)."""
    chunks = whole.chunk(shards)
    return chunks[index] if index < len(chunks) else whole[:0]
