"""The DLPack 1.3 C exchange API (``type(x).__dlpack_c_exchange_api__``) on the consume path.

A hand-built exchange table (plain ctypes: a ``DLPackExchangeAPI`` struct whose functions are
ctypes callbacks, published as a ``"dlpack_exchange_api"`` capsule on a producer type) stands in
for a C producer, so every rule is tested without torch: the table is used for the plain request
(one C call, no ``__dlpack__``/``__dlpack_device__``), an unknown version or a failing call falls
back to the Python protocol, every tensor's deleter runs exactly once, and errors are those of
the protocol path. torch (which publishes a real table) is tested where installed, and a
subprocess checks the package without torch.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import CapsuleFactory, capsule_pointer, rename_capsule
from cuda_fake import FakeCudaRuntime

import dlpack_ctypes as dl
from dlpack_ctypes import abi, exchange
from pb_tensor import cuda
from pb_tensor.errors import TritonBufferError, TritonModelException
from pb_tensor.tensor import Tensor

FROM_PY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
WORK_STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p)
UNUSED = ctypes.CFUNCTYPE(ctypes.c_int)
_PyCapsule_New = ctypes.PYFUNCTYPE(
    ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
)(("PyCapsule_New", ctypes.pythonapi))
_API_NAME = ctypes.create_string_buffer(b"dlpack_exchange_api")
_OTHER_NAME = ctypes.create_string_buffer(b"not_the_exchange_api")
# Exchange tables live for the process (the spec requires it; wrappers are cached by address).
_TABLES: list[object] = []

GPU_UNAVAILABLE = (
    "DLPack capsule passed pointer to memory allocated on GPU device, when GPU is not available: "
)


class FakeExchange:
    """A ``DLPackExchangeAPI`` built from ctypes. ``fail`` makes
    ``managed_tensor_from_py_object_no_sync`` return -1; ``stream`` is what
    ``current_work_stream`` reports. Calls are appended to :attr:`calls` (and to the producer's
    CUDA fake, if it has one, so that their order shows in the CUDA record)."""

    def __init__(
        self,
        version: tuple[int, int] = (1, 3),
        *,
        prev: FakeExchange | None = None,
        null_from_py: bool = False,
        capsule_name: ctypes.Array[ctypes.c_char] = _API_NAME,
    ) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fakes: list[FakeCudaRuntime] = []
        self.fail = False
        self.stream = 0
        self._from_py = FROM_PY(self._from_py_impl)
        self._work_stream = WORK_STREAM(self._work_stream_impl)
        self._unused = UNUSED(lambda: -1)
        unused = ctypes.cast(self._unused, ctypes.c_void_p).value
        table = self.table = abi.DLPackExchangeAPI()
        table.header.version.major, table.header.version.minor = version
        if prev is not None:
            table.header.prev_api = ctypes.pointer(prev.table.header)
        table.managed_tensor_allocator = unused
        table.managed_tensor_to_py_object_no_sync = unused
        table.dltensor_from_py_object_no_sync = None
        table.managed_tensor_from_py_object_no_sync = (
            None if null_from_py else ctypes.cast(self._from_py, ctypes.c_void_p).value
        )
        table.current_work_stream = ctypes.cast(self._work_stream, ctypes.c_void_p).value
        self.capsule = _PyCapsule_New(
            ctypes.addressof(table), ctypes.addressof(capsule_name), None
        )
        _TABLES.append(self)

    def _from_py_impl(self, obj_address: int | None, out: int | None) -> int:
        try:
            producer = ctypes.cast(obj_address, ctypes.py_object).value
            self.calls.append(("from_py_object", producer))
            producer.record("from_py_object")
            if self.fail:
                return -1
            capsule = producer.capsule(versioned=True)
            address = capsule_pointer(capsule, b"dltensor_versioned")
            rename_capsule(capsule, b"used_dltensor_versioned")  # ownership moves to the caller
            ctypes.c_void_p.from_address(out or 0).value = address
            return 0
        except Exception:  # a C function must not raise: report failure
            return -1

    def _work_stream_impl(self, device_type: int, device_id: int, out: int | None) -> int:
        self.calls.append(("current_work_stream", device_type, device_id))
        for producer_fake in self.fakes:
            producer_fake.calls.append(("current_work_stream", device_type, device_id))
        ctypes.c_void_p.from_address(out or 0).value = self.stream or None
        return 0

    def producer_type(self) -> type[Producer]:
        """A producer class publishing this table."""
        return type("ExchangeProducer", (Producer,), {exchange.ATTRIBUTE: self.capsule})


class Producer:
    """A DLPack producer over host memory (or fake device memory) whose capsules are built by
    hand with the counting deleter of ``make_capsule``; records what it is asked."""

    def __init__(
        self,
        factory: CapsuleFactory,
        array: np.ndarray[Any, Any],
        *,
        device: tuple[int, int] = (1, 0),
        dtype: tuple[int, int, int] | None = None,
        strides: Any = "c",
        data: int | None = None,
        fake: FakeCudaRuntime | None = None,
    ) -> None:
        self.factory = factory
        self.array = array
        self.device = device
        self.dtype = dtype
        self.strides = strides
        self.data = data
        self.fake = fake
        self.requests: list[str] = []

    def record(self, what: str) -> None:
        self.requests.append(what)
        if self.fake is not None:
            self.fake.calls.append((what,))

    def capsule(self, *, versioned: bool) -> Any:
        capsule, _info = self.factory(
            self.array,
            dtype=self.dtype,
            strides=self.strides,
            data=self.data,
            device=self.device,
            version=(1, 3) if versioned else None,
        )
        return capsule

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.record("__dlpack__")
        return self.capsule(versioned=kwargs.get("max_version") is not None)

    def __dlpack_device__(self) -> tuple[int, int]:
        self.record("__dlpack_device__")
        return self.device


class PlainProducer(Producer):
    """The same producer without an exchange table: the protocol path."""


def _error(fn: Any) -> tuple[type[BaseException], str]:
    """The type and text of what ``fn()`` raises (it must raise)."""
    try:
        fn()
    except Exception as exc:
        return type(exc), str(exc)
    raise AssertionError(f"{fn} did not raise")


@pytest.fixture
def table() -> FakeExchange:
    return FakeExchange()


# ---------------------------------------------------------------------------------------------
# Discovery


def test_hand_built_table_is_found(table: FakeExchange) -> None:
    api = exchange.exchange_api(table.producer_type())
    assert api is not None
    assert api.address == ctypes.addressof(table.table)
    assert api.version == (1, 3)
    assert exchange.exchange_api(PlainProducer) is None
    assert exchange.exchange_api(np.ndarray) is None  # numpy 2.4 publishes none


@pytest.mark.parametrize("version", [(2, 0), (0, 9), (1, 1), (1, 0)])
def test_unknown_version_is_not_used(version: tuple[int, int]) -> None:
    assert exchange.exchange_api(FakeExchange(version).producer_type()) is None


def test_newer_major_walks_prev_api() -> None:
    old = FakeExchange((1, 3))
    new = FakeExchange((2, 0), prev=old)
    api = exchange.exchange_api(new.producer_type())
    assert api is not None
    assert (api.address, api.version) == (ctypes.addressof(old.table), (1, 3))


def test_unusable_tables_are_not_used() -> None:
    assert exchange.exchange_api(FakeExchange(null_from_py=True).producer_type()) is None
    wrong_name = FakeExchange(capsule_name=_OTHER_NAME).producer_type()
    assert exchange.exchange_api(wrong_name) is None
    as_int = type("IntApi", (Producer,), {exchange.ATTRIBUTE: 1234})
    assert exchange.exchange_api(as_int) is None


def test_inherited_table_is_not_used(table: FakeExchange) -> None:
    # A subclass may override __dlpack__; the table would bypass that.
    sub = type("Sub", (table.producer_type(),), {})
    assert exchange.exchange_api(sub) is None


# ---------------------------------------------------------------------------------------------
# Consuming through the table


def test_from_dlpack_uses_one_c_call(table: FakeExchange, make_capsule: CapsuleFactory) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    producer = table.producer_type()(make_capsule, a)
    imported = dl.from_dlpack(producer)
    assert producer.requests == ["from_py_object"]
    assert imported.version == (1, 3)
    view = imported.numpy()
    assert view.ctypes.data == a.ctypes.data
    np.testing.assert_array_equal(view, a)
    (info,) = make_capsule.created
    assert info.calls == 0
    del imported, view
    assert info.calls == 1


def test_tensor_from_dlpack_uses_one_c_call(
    table: FakeExchange, make_capsule: CapsuleFactory
) -> None:
    a = np.arange(6, dtype=np.int32).reshape(3, 2)
    producer = table.producer_type()(make_capsule, a)
    t = Tensor.from_dlpack("x", producer)
    assert producer.requests == ["from_py_object"]
    assert t.is_cpu()
    assert t.shape() == [3, 2]
    assert t.as_numpy().ctypes.data == a.ctypes.data
    (info,) = make_capsule.created
    del t
    assert info.calls == 1


@pytest.mark.parametrize("consumer", ["dl", "Tensor"])
def test_failing_call_falls_back_to_protocol(
    table: FakeExchange, make_capsule: CapsuleFactory, consumer: str
) -> None:
    table.fail = True
    a = np.arange(4, dtype=np.float64)
    producer = table.producer_type()(make_capsule, a)
    if consumer == "dl":
        np.testing.assert_array_equal(dl.from_dlpack(producer).numpy(), a)
        assert producer.requests == ["from_py_object", "__dlpack__"]
    else:
        np.testing.assert_array_equal(Tensor.from_dlpack("x", producer).as_numpy(), a)
        assert producer.requests == ["from_py_object", "__dlpack_device__", "__dlpack__"]


def test_unknown_version_falls_back(make_capsule: CapsuleFactory) -> None:
    table = FakeExchange((2, 0))
    producer = table.producer_type()(make_capsule, np.ones(3, np.float32))
    dl.from_dlpack(producer)
    assert producer.requests == ["__dlpack__"]
    assert table.calls == []


def test_kwargs_take_the_protocol(table: FakeExchange, make_capsule: CapsuleFactory) -> None:
    # copy/device/stream must be negotiated: only __dlpack__ can.
    producer = table.producer_type()(make_capsule, np.ones(3, np.float32))
    dl.from_dlpack(producer, device=(1, 0))
    assert producer.requests == ["__dlpack__"]


# Invalid tensors: the producer's arguments, and the consumers that reject them.
INVALID: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "unknown dtype code": ({"dtype": (99, 32, 1)}, ("dl", "Tensor")),
    "bad bits": ({"dtype": (2, 12, 1)}, ("dl", "Tensor")),
    "NULL data": ({"data": 0}, ("dl", "Tensor")),
    "not contiguous": ({"strides": (-1,)}, ("Tensor",)),
    "no Triton dtype": ({"dtype": (5, 32, 1)}, ("Tensor",)),
}


@pytest.mark.parametrize(
    ("case", "consumer"),
    [(case, who) for case, (_, consumers) in sorted(INVALID.items()) for who in consumers],
)
def test_errors_identical_to_protocol_path_and_deleter_once(
    table: FakeExchange, make_capsule: CapsuleFactory, case: str, consumer: str
) -> None:
    a = np.arange(4, dtype=np.float32)
    kwargs = INVALID[case][0]
    fast = table.producer_type()(make_capsule, a, **kwargs)
    slow = PlainProducer(make_capsule, a, **kwargs)
    if consumer == "dl":
        got, expected = _error(lambda: dl.from_dlpack(fast)), _error(lambda: dl.from_dlpack(slow))
    else:
        got = _error(lambda: Tensor.from_dlpack("x", fast))
        expected = _error(lambda: Tensor.from_dlpack("x", slow))
    assert got == expected
    assert fast.requests == ["from_py_object"]
    # make_capsule checks that every tensor, adopted or not, was released exactly once.


def test_check_rejection_releases_once(table: FakeExchange, make_capsule: CapsuleFactory) -> None:
    def check(t: dl.DLPackTensor) -> None:
        raise BufferError(f"rejected {t.shape}")

    producer = table.producer_type()(make_capsule, np.ones((2, 2), np.float32))
    with pytest.raises(BufferError, match=r"^rejected \(2, 2\)$"):
        dl.from_dlpack(producer, check=check)
    (info,) = make_capsule.created
    assert info.calls == 1


def test_threads_each_get_their_own_tensor(
    table: FakeExchange, make_capsule: CapsuleFactory
) -> None:
    arrays = [np.full(8, i, dtype=np.int64) for i in range(8)]
    cls = table.producer_type()
    producers = [cls(make_capsule, a) for a in arrays]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(50):
                with dl.from_dlpack(producers[i]) as imported:
                    assert imported.data == arrays[i].ctypes.data
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert len(make_capsule.created) == 400


# ---------------------------------------------------------------------------------------------
# GPU: no __dlpack__(stream=...) to order the work, so the consumer waits on the producer's
# current work stream itself.


@pytest.fixture
def gpu_table(fake: FakeCudaRuntime) -> Iterator[FakeExchange]:
    table = FakeExchange()
    table.fakes = [fake]
    err, table.stream = fake.cudaStreamCreate()
    assert err == 0
    fake.take()
    yield table
    table.fakes = []


def test_gpu_import_waits_for_the_work_stream(
    fake: FakeCudaRuntime, gpu_table: FakeExchange, make_capsule: CapsuleFactory
) -> None:
    host = np.arange(6, dtype=np.float32).reshape(2, 3)
    producer = gpu_table.producer_type()(
        make_capsule, host, device=(2, 1), data=0x7F00_0000_1000, fake=fake
    )
    t = Tensor.from_dlpack("x", producer)
    stream = gpu_table.stream
    assert fake.take() == [
        ("from_py_object",),
        ("current_work_stream", 2, 1),
        ("cudaGetDevice",),
        ("cudaSetDevice", 1),
        ("cudaStreamSynchronize", stream),
        ("cuDevicePrimaryCtxGetState", 0),
        ("cudaSetDevice", 0),
    ]
    assert not t.is_cpu()
    assert t.data_ptr == 0x7F00_0000_1000
    assert t.__dlpack_device__() == (2, 1)


def test_gpu_dl_from_dlpack_keeps_the_protocol(
    fake: FakeCudaRuntime, gpu_table: FakeExchange, make_capsule: CapsuleFactory
) -> None:
    # dlpack_ctypes cannot order CUDA work itself: a stream-ordered tensor goes back to the
    # producer (deleter once) and the protocol is asked instead.
    producer = gpu_table.producer_type()(
        make_capsule, np.ones(4, np.float32), device=(2, 0), data=0x7F00_0000_2000, fake=fake
    )
    imported = dl.from_dlpack(producer)
    assert producer.requests == ["from_py_object", "__dlpack__"]
    first, second = make_capsule.created
    assert (first.calls, second.calls) == (1, 0)
    assert imported.device == (dl.DLDeviceType.kDLCUDA, 0)


def test_gpu_without_cuda_same_error_released_once(
    fake: FakeCudaRuntime, gpu_table: FakeExchange, make_capsule: CapsuleFactory
) -> None:
    cuda.set_runtime(FakeCudaRuntime(no_driver=True))
    kwargs: dict[str, Any] = {"device": (2, 0), "data": 0x1000}
    host = np.ones(4, np.float32)
    fast = gpu_table.producer_type()(make_capsule, host, **kwargs)
    slow = PlainProducer(make_capsule, host, **kwargs)
    got = _error(lambda: Tensor.from_dlpack("x", fast))
    assert got == _error(lambda: Tensor.from_dlpack("x", slow))
    assert got[0] is cuda.CudaUnavailableError
    assert got[1].startswith(GPU_UNAVAILABLE + "CUDA is not available: ")
    assert fast.requests == ["from_py_object"]


def test_gpu_sync_failure_same_error_released_once(
    fake: FakeCudaRuntime, gpu_table: FakeExchange, make_capsule: CapsuleFactory
) -> None:
    kwargs: dict[str, Any] = {"device": (2, 1), "data": 0x7F00_0000_3000}
    host = np.ones(4, np.float32)
    fast = gpu_table.producer_type()(make_capsule, host, **kwargs)
    slow = PlainProducer(make_capsule, host, **kwargs)
    fake.fail("cudaStreamSynchronize", 719)
    got = _error(lambda: Tensor.from_dlpack("x", fast))
    fake.fail("cudaStreamSynchronize", 719)
    assert got == _error(lambda: Tensor.from_dlpack("x", slow))
    assert got[0] is cuda.CudaError
    assert got[1].startswith("Failed to synchronize CUDA device with id 1: cudaErrorLaunchFailure")
    assert fake.current == 0  # the caller's device is restored
    # make_capsule checks that the exchanged tensor was released exactly once.


# ---------------------------------------------------------------------------------------------
# torch: a real table


@pytest.fixture
def torch() -> Any:
    return pytest.importorskip("torch")


@pytest.fixture
def protocol_only(monkeypatch: pytest.MonkeyPatch, torch: Any) -> None:
    """torch.Tensor without its exchange table (the cache answers None)."""
    monkeypatch.setitem(exchange._BY_TYPE, torch.Tensor, None)


def test_torch_publishes_a_table(torch: Any) -> None:
    api = exchange.exchange_api(torch.Tensor)
    assert api is not None
    assert api.version >= (1, 3)
    assert api.version[0] == 1
    assert api.current_work_stream(int(dl.DLDeviceType.kDLCPU), 0) == 0
    assert exchange.exchange_api(torch.nn.Parameter) is None  # inherits it


def test_torch_import_skips_the_python_protocol(
    torch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the Python protocol was called")

    monkeypatch.setattr(torch.Tensor, "__dlpack__", refuse)
    monkeypatch.setattr(torch.Tensor, "__dlpack_device__", refuse)
    view = dl.from_dlpack(t).numpy()
    view[0, 0] = 42
    assert t[0, 0].item() == 42
    tensor = Tensor.from_dlpack("x", t)
    assert tensor.data_ptr == t.data_ptr()
    assert tensor.shape() == [2, 3]


TORCH_REFUSED = {
    "requires_grad": lambda torch: torch.ones(2, requires_grad=True),
    "conjugate bit": lambda torch: torch.ones(2, dtype=torch.complex64).conj(),
    "sparse": lambda torch: torch.ones(2, 2).to_sparse(),
    "meta": lambda torch: torch.ones(2, device="meta"),
}


@pytest.mark.parametrize("case", sorted(TORCH_REFUSED))
def test_torch_refusals_identical_to_protocol(
    torch: Any, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    t = TORCH_REFUSED[case](torch)
    got = [_error(lambda: dl.from_dlpack(t)), _error(lambda: Tensor.from_dlpack("x", t))]
    monkeypatch.setitem(exchange._BY_TYPE, torch.Tensor, None)
    expected = [_error(lambda: dl.from_dlpack(t)), _error(lambda: Tensor.from_dlpack("x", t))]
    assert got == expected
    assert got[1][0] in (TritonBufferError, TritonModelException)


def test_torch_values_match_protocol(torch: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = [
        torch.arange(12, dtype=torch.int16).reshape(3, 4),
        torch.arange(12.0).reshape(3, 4).t(),  # strided: dl accepts, Tensor refuses
        torch.tensor(3.5),
        torch.empty((0, 3)),
        torch.ones(2, 3, dtype=torch.bfloat16),
        torch.ones(2, dtype=torch.complex64).conj().imag,  # the negative bit: exported as is
    ]

    def describe(t: Any) -> list[Any]:
        out: list[Any] = []
        with dl.from_dlpack(t) as imported:
            out.append((imported.data, imported.shape, imported.strides, imported.dtype,
                        imported.device, imported.flags))
        try:
            x = Tensor.from_dlpack("x", t)
            out.append((x.data_ptr, x.shape(), x.triton_dtype()))
        except TritonModelException as exc:
            out.append(str(exc))
        return out

    got = [describe(t) for t in tensors]
    monkeypatch.setitem(exchange._BY_TYPE, torch.Tensor, None)
    assert got == [describe(t) for t in tensors]


def test_torch_function_mode_takes_the_protocol(torch: Any) -> None:
    seen: list[str] = []

    class Recorder(torch.overrides.TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            seen.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    t = torch.arange(3.0)
    with Recorder():
        imported = dl.from_dlpack(t)
    assert "__dlpack__" in seen
    assert imported.data == t.data_ptr()
    # Tensor.from_dlpack too: neither the exchange table nor torch's numpy bridge is used.
    Tensor.from_dlpack("warm", torch.zeros(1))  # binds torch.Tensor for the bridge
    seen.clear()
    with Recorder():
        x = Tensor.from_dlpack("x", t)
    assert "__dlpack__" in seen
    assert x.data_ptr == t.data_ptr()


def test_without_torch(run_python: Any) -> None:
    result = run_python(
        """
        import sys
        sys.modules["torch"] = None  # import torch -> ImportError
        import numpy as np
        import dlpack_ctypes as dl
        from dlpack_ctypes import exchange
        from pb_tensor import Tensor
        a = np.arange(6, dtype=np.float32)
        assert exchange.exchange_api(np.ndarray) is None
        assert dl.from_dlpack(a).numpy().ctypes.data == a.ctypes.data
        assert Tensor.from_dlpack("x", a).as_numpy().ctypes.data == a.ctypes.data
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok\n"


def test_interrupted_discovery_never_leaves_later_imports_hanging(run_python: Any) -> None:
    # A KeyboardInterrupt at any bytecode of the first discovery of a type (including the
    # instant between a with-block's end and its __exit__, which Python does not protect) must
    # leave the caches usable: the next discovery completes and finds the same table.
    pytest.importorskip("torch")
    result = run_python(
        """
        import sys
        import torch
        from dlpack_ctypes import exchange

        class Injected(KeyboardInterrupt):
            pass

        def run_at(k):
            count = [0]

            def tracer(frame, event, arg):
                if frame.f_code.co_filename != exchange.__file__:
                    return None
                if event == "call":
                    frame.f_trace_opcodes = True
                    frame.f_trace_lines = False
                    return tracer
                if event == "opcode":
                    count[0] += 1
                    if count[0] == k:
                        raise Injected
                return tracer

            exchange._BY_TYPE.pop(torch.Tensor, None)
            exchange._BY_ADDRESS.clear()
            sys.settrace(tracer)
            try:
                exchange.exchange_api(torch.Tensor)
            except Injected:
                pass
            finally:
                sys.settrace(None)
            return count[0] >= k

        expected = None
        k = 1
        while run_at(k):
            api = exchange.exchange_api(torch.Tensor)  # hangs if a lock was left held
            assert api is not None, k
            expected = expected or api.address
            assert api.address == expected, k
            k += 1
        print("ok", k > 20)
        """,
        timeout=120,
        warnings_as_errors=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok True\n"
