"""CUDA graphs of numba launches: capture a forward once, replay it every step.

A numba launch costs 20-50 us on the host; a replayed graph ~0.5-0.9 us a kernel
(shared/gpu/NOTES.md). Everything a captured forward reads must sit at a fixed address
(inputs are copied into fixed buffers before replay), and everything that changes per
step (context length, block table, positions) must be read from device memory.
"""
from __future__ import annotations


# captured graphs and the edges made programmatic in them (luce.kernels.pdl), for reports
STATS = {"graphs": 0, "programmatic": 0}


def _check(result):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        from cuda.bindings import driver
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"CUDA graph call failed: {name.decode() if isinstance(name, bytes) else name}")
    return result[1] if isinstance(result, tuple) and len(result) == 2 else result


class Graph:
    """The launches `fn()` makes on `stream` (a numba stream), captured for replay; with
    luce.kernels.pdl on, kernels marked ready for it are launched programmatically (before
    the kernel they depend on has finished: see that module)."""

    def __init__(self, stream, fn):
        from cuda.bindings import driver

        from ..kernels import pdl
        self.stream = stream
        self.programmatic = 0  # edges made programmatic
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        launches = []
        _check(driver.cuStreamBeginCapture(stream.handle, mode))
        try:
            if pdl.ENABLED:
                with _recording(launches):
                    fn()
            else:
                fn()
        finally:
            graph = _check(driver.cuStreamEndCapture(stream.handle))
        self._graph = graph
        edges = _make_programmatic(graph, launches) if pdl.ENABLED else []
        try:
            self._exec = _check(driver.cuGraphInstantiate(graph, 0))
        except RuntimeError as err:
            if not edges:
                raise
            _set_edges(graph, edges, programmatic=False)  # as captured, once warned
            import warnings
            warnings.warn(f"LUCE_PDL: a graph with programmatic edges did not instantiate ({err}); "
                          "it keeps full dependencies", stacklevel=2)
            edges = []
            self._exec = _check(driver.cuGraphInstantiate(graph, 0))
        self.programmatic = len(edges)
        STATS["graphs"] += 1
        STATS["programmatic"] += self.programmatic

    def replay(self) -> None:
        from cuda.bindings import driver
        _check(driver.cuGraphLaunch(self._exec, self.stream.handle))

    def __del__(self):
        try:
            from cuda.bindings import driver
            driver.cuGraphExecDestroy(self._exec)
            driver.cuGraphDestroy(self._graph)
        except Exception:  # interpreter shutdown: the driver frees them with the context
            pass


class _recording:
    """Record (ready for PDL, grid, block) of every numba kernel launch while open."""

    def __init__(self, launches: list):
        self.launches = launches

    def __enter__(self):
        from numba.cuda import dispatcher

        from ..kernels import pdl
        self._cls = dispatcher._Kernel
        self._launch = launch = self._cls.launch
        launches = self.launches

        def recorded(kernel, args, griddim, blockdim, stream=0, sharedmem=0):
            launches.append((pdl.is_ready(kernel.py_func), pdl.dim3(griddim), pdl.dim3(blockdim)))
            return launch(kernel, args, griddim, blockdim, stream, sharedmem)
        self._cls.launch = recorded
        return self

    def __exit__(self, *exc):
        self._cls.launch = self._launch


def _chain(graph):
    """(the graph's nodes in order, or None where they are not one chain; their kinds;
    kernel nodes' (grid, block))."""
    from cuda.bindings import driver

    from ..kernels.pdl import dim3

    def listed(call, what):  # (err, lists..., count): asked once for the count, then filled
        got = call(graph, 0)
        _check(got[0])
        n = int(got[-1])
        got = call(graph, n) if n else got
        _check(got[0])
        return [list(got[i] or [])[:n] for i in what]
    nodes, = listed(driver.cuGraphGetNodes, (1,))
    src, dst = listed(driver.cuGraphGetEdges, (1, 2))
    key = lambda node: int(node)  # noqa: E731
    kinds, dims = {}, {}
    for node in nodes:
        kind = _check(driver.cuGraphNodeGetType(node))
        if kind == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            kinds[key(node)] = "kernel"
            p = _check(driver.cuGraphKernelNodeGetParams(node))
            dims[key(node)] = (dim3((p.gridDimX, p.gridDimY, p.gridDimZ)),
                               dim3((p.blockDimX, p.blockDimY, p.blockDimZ)))
        else:
            kinds[key(node)] = str(kind)
    nxt = {key(a): b for a, b in zip(src, dst)}
    ins = {key(b) for b in dst}
    if len(nxt) != len(src) or len(ins) != len(dst) or len(nodes) - len(src) != 1:  # branches: not a chain
        return None, kinds, dims, {}
    first = [node for node in nodes if key(node) not in ins]
    order, handles = [], {}
    node = first[0] if first else None
    while node is not None:
        order.append(key(node))
        handles[key(node)] = node
        node = nxt.get(key(node))
    return (order if len(order) == len(nodes) else None), kinds, dims, handles


def _edge_data(programmatic: bool):
    from cuda.bindings import driver
    if not programmatic:
        return None  # default (zeroed) data: full completion and memory visibility
    e = driver.CUgraphEdgeData()
    e.type = driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    e.from_port = driver.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
    return [e]


def _set_edges(graph, edges, programmatic: bool) -> None:
    """Replace each (node a, node b) edge by one of the other kind; an edge whose new form
    is refused gets its old one back, so a and b are never left unordered."""
    from cuda.bindings import driver
    for na, nb in edges:
        _check(driver.cuGraphRemoveDependencies(graph, [na], [nb], _edge_data(not programmatic), 1))
        try:
            _check(driver.cuGraphAddDependencies(graph, [na], [nb], _edge_data(programmatic), 1))
        except Exception:
            _check(driver.cuGraphAddDependencies(graph, [na], [nb], _edge_data(not programmatic), 1))
            raise


def _make_programmatic(graph, launches) -> list:
    """Turn the captured chain's edges into kernels marked ready into programmatic ones
    (luce.kernels.pdl.programmatic_edges); returns the (node, node) edges changed. Any
    failure leaves the rest as captured (full dependencies), once warned."""
    from ..kernels.pdl import programmatic_edges
    done = []
    try:
        order, kinds, dims, handles = _chain(graph)
        for a, b in programmatic_edges(order, kinds, dims, launches):
            _set_edges(graph, [(handles[a], handles[b])], programmatic=True)
            done.append((handles[a], handles[b]))
    except Exception as err:  # an older driver or binding
        import warnings
        warnings.warn(f"LUCE_PDL: {len(done)} programmatic edges made, then {err}", stacklevel=3)
    return done
