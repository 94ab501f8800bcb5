"""The per-token copy helpers' device-address cache: it must answer what the array's
__cuda_array_interface__ says, forget arrays that are gone, and never call an elementwise ==."""
import gc

from luce.backends import cuda_copy


class Buf:
    def __init__(self, ptr):
        self.reads = 0
        self.ptr = ptr

    @property
    def __cuda_array_interface__(self):
        self.reads += 1
        return {"data": (self.ptr, False)}


class Elementwise(Buf):
    def __eq__(self, other):  # what torch tensors do: a weak-key lookup must not call it
        raise AssertionError("== called")

    __hash__ = object.__hash__


def test_dev_ptr_is_remembered_while_the_array_lives():
    a, b = Buf(0x1000), Buf(0x2000)
    assert [cuda_copy.dev_ptr(a), cuda_copy.dev_ptr(b), cuda_copy.dev_ptr(a)] == [0x1000, 0x2000, 0x1000]
    assert a.reads == 1 and b.reads == 1
    n = len(cuda_copy._PTRS)
    del a
    gc.collect()
    assert len(cuda_copy._PTRS) == n - 1


def test_dev_ptr_of_objects_with_their_own_equality_is_not_cached():
    e = Elementwise(0x3000)
    assert cuda_copy.dev_ptr(e) == 0x3000 and cuda_copy.dev_ptr(e) == 0x3000
    assert e.reads == 2
