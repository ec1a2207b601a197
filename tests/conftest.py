"""Fixtures shared by several test files, and each pytest-xdist worker's share of the cores."""

import errno
import os
from types import SimpleNamespace

import pytest

from tiny import free_port, markov_tokens


def pytest_configure(config):
    """Under pytest-xdist (`make test`: -n auto) the workers share the cores: each takes cores / workers threads, for
    torch in-process and (OMP_NUM_THREADS) for the processes it starts that do not set their own. The tests' train.py
    subprocesses and torchrun ranks run with one thread (tests/tiny.py): on 2 cores an in-process run then sums as
    they do. A plain `pytest` (no -n) leaves torch's default."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        import torch

        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


TOKENIZER_CORPUS = [
    "Once upon a time there was a naïve café owner 😀 who said hello to the world.",
    "The quick brown fox jumps over the lazy dog; 日本語 and ünïcödé too.",
    "A man is sitting on a roof. He starts pulling up roofing on a roof.",
]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """tests/tiny.py's Markov-chain data: a train shard of 30,000 tokens and a val shard of 3,000 (read only: a test
    that changes it copies it first)."""
    from gpt2train.shards import write_shard

    d = tmp_path_factory.mktemp("data")
    write_shard(d / "tiny_train_000000.bin", markov_tokens(30_000, seed=1))
    write_shard(d / "tiny_val_000000.bin", markov_tokens(3_000, seed=2))
    return d


@pytest.fixture
def one_rank_torchrun(monkeypatch):
    """The environment torchrun --nproc_per_node=1 gives its process: train.main in-process joins a process
    group of one, so parallel='fsdp' shards (over one rank) and writes sharded checkpoints."""
    import torch.distributed as dist

    for key, value in dict(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    ).items():
        monkeypatch.setenv(key, value)
    yield
    if dist.is_initialized():  # a failed run may not have reached its cleanup
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def byte_level_tokenizer_json(tmp_path_factory):
    """A tiny byte-level BPE tokenizer.json (GPT-NeoX style: <|endoftext|> is id 0), trained here with the
    `tokenizers` library: 256 byte tokens + merges + the special token, under 320 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TOKENIZER_CORPUS * 20, trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def neox_tokenizer_json(tmp_path_factory):
    """A tokenizer.json built as GPT-NeoX's / Pythia's is (no network): NFC normalizer, GPT-2's byte-level
    pre-tokenizer, <|endoftext|> id 0 and <|padding|> id 1 as special tokens, a non-special added token for a run of
    spaces, then the BPE vocabulary; trained here on a tiny corpus, 400 ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=399,
        special_tokens=["<|endoftext|>", "<|padding|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TOKENIZER_CORPUS * 20, trainer)
    tok.add_tokens([AddedToken("    ", normalized=False)])
    path = tmp_path_factory.mktemp("neox") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture
def read_only(monkeypatch):
    """read_only(directory): from now on, writes under `directory` fail with EACCES as on a read-only mount
    (the tests may run as root, whom chmod does not stop)."""
    real_open, real_os_open, real_mkdir = open, os.open, os.mkdir

    def refuse(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    def make(directory):
        inside = lambda path: str(path).startswith(str(directory))  # noqa: E731
        writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT
        monkeypatch.setattr(
            "builtins.open",
            lambda path, mode="r", *a, **k: (
                refuse(path) if inside(path) and set(mode) & set("wax+") else real_open(path, mode, *a, **k)
            ),
        )
        monkeypatch.setattr(
            os,
            "open",
            lambda path, flags, *a, **k: (
                refuse(path) if inside(path) and flags & writes else real_os_open(path, flags, *a, **k)
            ),
        )
        monkeypatch.setattr(
            os, "mkdir", lambda path, *a, **k: refuse(path) if inside(path) else real_mkdir(path, *a, **k)
        )

    return make


@pytest.fixture
def fake_gpus(monkeypatch):
    """fake_gpus(n): this CPU-only torch sees n CUDA GPUs. Only the device queries and the runtime calls below
    them are mocked (is_available, device_count, current_device, properties, free memory, set-device): torch's
    own functions and their argument parsing (torch.cuda._utils._get_device_index) run, so a call a real GPU
    would reject (set_device('cuda'), an index out of range) fails here too. Returns the state: current device,
    and every index set_device reached."""
    from types import SimpleNamespace

    import torch
    from torch.cuda._utils import _get_device_index

    def make(n=2, name="NVIDIA H100 80GB HBM3", capability=(9, 0)):
        state = SimpleNamespace(current=0, set_to=[])

        def index(device):
            i = _get_device_index(device, optional=True)
            if not 0 <= i < n:
                raise AssertionError(f"Invalid device id {i}")  # what torch says
            return i

        def set_device(i):
            state.current = index(i)
            state.set_to.append(i)

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: state.current)
        monkeypatch.setattr(torch._C, "_cuda_setDevice", set_device, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", index, raising=False)
        monkeypatch.setattr(
            torch.cuda,
            "cudart",
            lambda: SimpleNamespace(cudaMemGetInfo=lambda i: (70 << 30, 80 << 30) if index(i) >= 0 else None),
        )
        monkeypatch.setattr(
            torch.cuda,
            "get_device_properties",
            lambda device=None: SimpleNamespace(
                name=name, major=capability[0], minor=capability[1], total_memory=80 << 30, index=index(device)
            ),
        )
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: capability >= (8, 0))
        return state

    return make


@pytest.fixture
def deadline():
    """deadline(seconds): a with block that fails instead of hanging past `seconds` (SIGALRM: a blocked open() of
    a FIFO or an endless read of /dev/zero is interrupted). It raises a BaseException, so that no `except OSError`
    or `except Exception` in the code under test turns the hang into an expected error."""
    import contextlib
    import signal

    class Hung(BaseException):
        pass

    @contextlib.contextmanager
    def limit(seconds):
        def expire(signum, frame):
            raise Hung(f"still running after {seconds} s")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    return limit


@pytest.fixture
def fake_device():
    """fake_device(name): a TorchFunctionMode (use it in a with block) under which tensors put on device `name`
    ('mps', 'cuda:0'), which this CPU-only torch lacks, live on the CPU and are tracked as on that device: a tensor
    made from them is on it too, and their .device says so. What the device refuses fails as there (MPS has no
    float64: the TypeError MPS raises), and the host-device synchronisations are counted in .syncs: a device
    tensor's value read on the host (item, tolist, bool, float, int, cpu, numpy, a copy to the CPU) and a copy
    to the device from pageable host memory (torch.tensor(data, device=...) too), which first waits for the work
    queued on the device; a copy from pinned memory (pin_memory()) does not."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten, tree_map
    from torch.utils.weak import WeakIdKeyDictionary

    Tensor = torch.Tensor
    reads = {Tensor.item, Tensor.tolist, Tensor.__bool__, Tensor.__float__, Tensor.__int__, Tensor.cpu, Tensor.numpy}
    device_of = Tensor.device.__get__

    class FakeDevice(TorchFunctionMode):
        def __init__(self, name):
            super().__init__()
            self.name, self.kind = torch.device(name), torch.device(name).type
            self.on, self.pinned, self.syncs = WeakIdKeyDictionary(), WeakIdKeyDictionary(), 0

        def here(self, a, kind=None):  # whether `a` names this device (or device type `kind`)
            return isinstance(a, (str, torch.device)) and str(a).split(":")[0] == (kind or self.kind)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            source = args[0] if args and isinstance(args[0], Tensor) else None
            on_device = source is not None and source in self.on
            if func == device_of and on_device:
                return self.name
            if func in (torch.device, torch._C._nn._parse_to):  # names a device, holds no tensor
                return func(*args, **kwargs)
            if func is Tensor.pin_memory:
                pinned = source.clone()
                self.pinned[pinned] = True
                return pinned
            moved = []  # this device named among the arguments: the CPU stands in for it
            args, kwargs = tree_map(
                lambda a: moved.append(a) or torch.device("cpu") if self.here(a) else a, (args, kwargs)
            )
            to_cpu = any(self.here(a, "cpu") for a in (*args[1:], *kwargs.values()))
            to_host = func in reads or func is Tensor.to and not moved and to_cpu
            if on_device and to_host:
                self.syncs += 1
            elif moved and (func is torch.tensor or func is Tensor.to and not on_device and source not in self.pinned):
                self.syncs += 1  # a copy from pageable host memory
            inputs = any(isinstance(t, Tensor) and t in self.on for t in tree_flatten((args, kwargs))[0])
            out = func(*args, **kwargs)
            if moved or inputs and not to_host:
                for t in tree_flatten(out)[0]:
                    if isinstance(t, Tensor):
                        if self.kind == "mps" and t.dtype == torch.float64:
                            raise TypeError(
                                "Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't support "
                                "float64. Please use float32 instead."
                            )
                        self.on[t] = True
            return out

    return FakeDevice


def data_cfg(data_dir, batch_size, block_size, seed=0, vocab_size=None, packing="window"):
    """What a data.DataLoader reads of a run's config (its cfg), for a test: the data and the micro-batch's shape;
    the rest as a loader of its own has them unless given (seed 0, no token-id check, window rows)."""
    return SimpleNamespace(
        data_dir=data_dir,
        batch_size=batch_size,
        block_size=block_size,
        seed=seed,
        vocab_size=vocab_size,
        packing=packing,
    )


def in_file_order(loader):
    """The loader (a data.Loader) with each source's samples read in file order, as a split other than train is."""
    for source, _ in loader.sources().values():
        source.shuffle = False
    return loader
