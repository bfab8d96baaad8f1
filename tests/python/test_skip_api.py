"""gpipe.skip: torchgpipe's skip API on plain models, verify_skippables' messages, skip_routes,
StageRunner (stage by stage == the plain model), pickling, threads, balancing with skips."""
import copy
import io
import pickle
import threading
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from torch import Tensor, nn

import gpipe
from gpipe.balance import balance_by_size, balance_by_time
from gpipe.skip import Namespace, Skippable, pop, skippable, stash, verify_skippables
from gpipe.skip import tracker as tracker_module
from gpipe.skip.layout import Route, has_skippables, skip_routes
from gpipe.skip.tracker import SkipTracker, StageRunner, current_skip_tracker, use_skip_tracker

CPU = torch.device("cpu")
TOL = 1e-10


# Module-level decorated classes: what pickle must find by name.
@skippable(stash=["skip"])
class StashSkip(nn.Module):
    """Stashes its input as 'skip'."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(features, features)

    def forward(self, x):
        yield stash("skip", x)
        return self.linear(x)


@skippable(pop=["skip"])
class PopSkip(nn.Module):
    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(features, features)

    def forward(self, x):
        skip = yield pop("skip")
        return self.linear(x) + skip


class Mix(nn.Module):
    """Adds every popped skip to its input, runs a Linear, stashes tanh of
    the result times a per-name factor under each stashed name. Decorated per
    use with the names: ``mix(stash=[...], pop=[...])``."""

    def __init__(self, stashes: Sequence[str], pops: Sequence[str], features: int = 4) -> None:
        super().__init__()
        self.stashes, self.pops = list(stashes), list(pops)
        self.linear = nn.Linear(features, features)

    def forward(self, x):
        for name in self.pops:
            skip = yield pop(name)
            if skip is not None:
                x = x + skip
        y = self.linear(x)
        for k, name in enumerate(self.stashes):
            yield stash(name, torch.tanh(y) * (k + 2))
        return y


def mix(stash: Sequence[str] = (), pop: Sequence[str] = (), features: int = 4) -> Skippable:
    return skippable(stash=stash, pop=pop)(Mix)(stash, pop, features)


@pytest.fixture(autouse=True)
def fresh_tracker():
    """Each test starts with its own default tracker (as torchgpipe's tests)."""
    with use_skip_tracker(SkipTracker()) as _:
        yield current_skip_tracker()


# -- torchgpipe semantics on plain models -------------------------------------------------------

def test_plain_model_adds_the_skip():
    torch.manual_seed(0)
    model = nn.Sequential(StashSkip(), nn.Tanh(), PopSkip()).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    expected = model[2].module.linear(torch.tanh(model[0].module.linear(x))) + x
    assert torch.equal(model(x), expected)
    assert not current_skip_tracker().tensors  # popped: nothing left behind


def test_the_default_tracker_serves_a_plain_model_on_any_thread():
    # No use_skip_tracker at all: a fresh thread makes its default tracker.
    model = nn.Sequential(StashSkip(), PopSkip())
    x = torch.randn(2, 4)
    results: Dict[str, object] = {}

    def run() -> None:
        results["y"] = model(x)
        results["tracker"] = current_skip_tracker()
        results["same"] = current_skip_tracker() is results["tracker"]

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert torch.allclose(results["y"], model(x))
    assert results["same"] and results["tracker"] is not current_skip_tracker()


def test_stash_and_pop_go_through_the_current_tracker(fresh_tracker):
    layer = StashSkip()
    x = torch.randn(2, 4)
    with use_skip_tracker(SkipTracker()):
        layer(x)
        inner = current_skip_tracker()
        assert list(inner.tensors) == [(None, "skip")] and inner.tensors[(None, "skip")] is x
    assert not fresh_tracker.tensors and fresh_tracker.portals == {}


def test_the_tracker_is_looked_up_through_the_module(monkeypatch):
    mine = SkipTracker()
    monkeypatch.setattr(tracker_module, "current_skip_tracker", lambda: mine)
    StashSkip()(torch.randn(2, 4))
    assert list(mine.tensors) == [(None, "skip")]


def test_stash_none_pops_none():
    @skippable(stash=["foo"])
    class Stash(nn.Module):
        def forward(self, x):
            yield stash("foo", None)
            return x * 2

    @skippable(pop=["foo"])
    class Pop(nn.Module):
        def forward(self, x):
            foo = yield pop("foo")
            assert foo is None
            return x + 1

    assert torch.equal(nn.Sequential(Stash(), Pop())(torch.tensor([1.0])), torch.tensor([3.0]))


def test_forward_without_yield_works():
    @skippable()
    class Plain(nn.Module):
        def forward(self, x):
            return x + 1

    assert torch.equal(Plain()(torch.tensor([1.0])), torch.tensor([2.0]))


def test_runtime_errors_say_torchgpipe_s_message_and_the_fix():
    @skippable(stash=["foo"])
    class Silent(nn.Module):
        def forward(self, x):
            return x * 2

    @skippable(pop=["foo"])
    class Deaf(nn.Module):
        def forward(self, x):
            return x * 3

    @skippable()
    class Undeclared(nn.Module):
        def forward(self, x):
            yield stash("foo", x)
            return x

    @skippable(stash=["foo"])
    class Stash(nn.Module):
        def forward(self, x):
            yield stash("foo", x)
            return x

    @skippable()
    class PopUndeclared(nn.Module):
        def forward(self, x):
            return (yield pop("foo"))

    @skippable(pop=["foo"])
    class Pop(nn.Module):
        def forward(self, x):
            return (yield pop("foo"))

    x = torch.tensor([42.0])
    with pytest.raises(RuntimeError, match=r"^'foo' must be stashed but have not \(in Silent"):
        Silent()(x)
    # Pop layers load their skips first: with nothing stashed that is what fails.
    with pytest.raises(RuntimeError, match=r"^'foo' has not been stashed \(popped by Deaf\)"):
        Deaf()(x)
    Stash()(x)
    with pytest.raises(RuntimeError, match=r"^'foo' must be popped but have not \(in Deaf"):
        Deaf()(x)
    with pytest.raises(RuntimeError, match=r"^'foo' has not been declared as stashable \(in "
                                           r"Undeclared\); add it: @skippable\(stash=\['foo'\]\)"):
        Undeclared()(x)
    Stash()(x)
    with pytest.raises(RuntimeError, match=r"^'foo' has not been declared as poppable \(in "
                                           r"PopUndeclared\); add it: @skippable\(pop=\['foo'\]\)"):
        PopUndeclared()(x)
    current_skip_tracker().tensors.clear()
    with pytest.raises(RuntimeError, match=r"^'foo' has not been stashed \(popped by Pop\); "
                                           r"stash it in an earlier layer"):
        Pop()(x)


def test_several_names_missing_are_listed_in_order():
    @skippable(stash=["b", "a", "c"])
    class Lazy(nn.Module):
        def forward(self, x):
            yield stash("b", x)
            return x

    with pytest.raises(RuntimeError, match=r"^'a', 'c' must be stashed but have not"):
        Lazy()(torch.zeros(1))


def test_a_yield_that_is_no_command_is_a_type_error():
    @skippable()
    class Odd(nn.Module):
        def forward(self, x):
            yield x
            return x

    with pytest.raises(TypeError, match=r"is not a command from @skippable"):
        Odd()(torch.zeros(1))


def test_popping_twice_is_refused():
    @skippable(pop=["foo"])
    class Greedy(nn.Module):
        def forward(self, x):
            yield pop("foo")
            yield pop("foo")
            return x

    current_skip_tracker().save(None, None, "foo", torch.zeros(1))
    with pytest.raises(RuntimeError, match="'foo' has been popped already"):
        Greedy()(torch.zeros(1))


# -- Namespace, the class made, isolate --------------------------------------------------------

def test_namespace():
    ns1, ns2 = Namespace(), Namespace()
    assert ns1 != ns2 and ns1 == ns1 and ns1 != None  # noqa: E711
    assert copy.copy(ns1) == ns1 and copy.copy(ns1) is not ns1
    assert copy.deepcopy(ns1) == ns1 and pickle.loads(pickle.dumps(ns1)) == ns1
    assert hash(copy.copy(ns1)) == hash(ns1) and len({ns1, copy.copy(ns1), ns2}) == 2
    assert sorted([ns2, ns1]) == sorted([ns1, ns2]) and (ns1 < ns2) != (ns2 < ns1)
    assert isinstance(None, Namespace) and isinstance(ns1, Namespace)
    # Keys mixing the default namespace and others sort without error.
    sorted([(ns1, "a"), (None, "a"), (ns2, "a")])
    assert repr(ns1) == f"<Namespace '{ns1.id}'>"


def test_the_made_class():
    assert issubclass(StashSkip, Skippable) and issubclass(Skippable, nn.Module)
    assert (StashSkip.__name__, StashSkip.__qualname__, StashSkip.__module__) == (
        "StashSkip", "StashSkip", __name__)
    assert StashSkip.__doc__ == "Stashes its input as 'skip'."
    assert StashSkip.stashable_names == frozenset({"skip"}) and PopSkip.poppable_names == {"skip"}
    assert isinstance(StashSkip.stashable_names, frozenset)
    assert StashSkip.poppable_names == frozenset()
    layer = StashSkip(3)
    assert isinstance(layer.module, StashSkip.module_cls) and layer.module.linear.in_features == 3
    assert list(layer.state_dict()) == ["module.linear.weight", "module.linear.bias"]
    assert repr(layer) == ("@skippable(StashSkip(\n"
                           "  (linear): Linear(in_features=3, out_features=3, bias=True)\n))")
    assert list(layer.stashable()) == [(None, "skip")] and list(layer.poppable()) == []


def test_isolate():
    ns1, ns2 = Namespace(), Namespace()
    layer = mix(stash=["alice", "bob"], pop=["carol"])
    assert layer.isolate(ns1) is layer
    assert sorted(layer.stashable(), key=lambda k: k[1]) == [(ns1, "alice"), (ns1, "bob")]
    assert list(layer.poppable()) == [(ns1, "carol")]
    layer.isolate(ns2, only=["bob"])
    assert layer.namespaced("bob") == (ns2, "bob") and layer.namespaced("alice") == (ns1, "alice")
    assert mix(stash=["x"]).namespaced("x") == (None, "x")


def test_isolated_skips_of_one_name_meet_their_own_partner():
    ns1, ns2 = Namespace(), Namespace()
    model = nn.Sequential(mix(stash=["x"]).isolate(ns1), mix(stash=["x"]).isolate(ns2),
                          mix(pop=["x"]).isolate(ns2), mix(pop=["x"]).isolate(ns1)).double()
    verify_skippables(model)
    x = torch.randn(2, 4, dtype=torch.float64)
    h0 = model[0].module.linear(x)
    h1 = model[1].module.linear(h0)
    h2 = model[2].module.linear(h1 + 2 * torch.tanh(h1))
    h3 = model[3].module.linear(h2 + 2 * torch.tanh(h0))
    assert torch.allclose(model(x), h3, rtol=0, atol=TOL)


# -- verify_skippables --------------------------------------------------------------------------

@skippable(stash=["1to3"])
class Layer1(nn.Module):
    pass


class Layer2(nn.Module):
    pass


@skippable(pop=["1to3"])
class Layer3(nn.Module):
    pass


def verify_message(*layers: nn.Module) -> str:
    with pytest.raises(TypeError) as e:
        verify_skippables(nn.Sequential(*layers))
    return str(e.value)


def test_verify_skippables_docstring_cases():
    head = "one or more pairs of stash and pop do not match:\n\n"
    verify_skippables(nn.Sequential(Layer1(), Layer2(), Layer3()))
    assert verify_message(Layer1(), Layer2()) == (
        head + "* no module declared '1to3' as poppable but stashed")
    assert verify_message(Layer2(), Layer3()) == (
        head + "* '1' declared '1to3' as poppable but it was not stashed")
    assert verify_message(Layer1(), Layer2(), Layer3(), Layer3()) == (
        head + "* '3' redeclared '1to3' as poppable but not isolated by namespace")
    assert verify_message(Layer1(), Layer1(), Layer2(), Layer3()) == (
        head + "* '1' redeclared '1to3' as stashable but not isolated by namespace")


def test_verify_skippables_other_cases():
    head = "one or more pairs of stash and pop do not match:\n\n"
    both = skippable(stash=["foo"], pop=["foo"])(Layer2)
    assert verify_message(both()) == (
        head + "* '0' declared 'foo' both as stashable and as poppable")
    # Stash, pop, stash, pop of one name: both second declarations are reported, in order.
    assert verify_message(Layer1(), Layer3(), Layer1(), Layer3()) == (
        head + "* '2' redeclared '1to3' as stashable but not isolated by namespace\n"
        "* '3' redeclared '1to3' as poppable but not isolated by namespace")
    # Layer names are the Sequential's child names.
    from collections import OrderedDict
    named = nn.Sequential(OrderedDict(enc=Layer1(), dec=Layer3(), again=Layer3()))
    with pytest.raises(TypeError, match="'again' redeclared '1to3' as poppable"):
        verify_skippables(named)
    # Stash and pop of different names in one layer are fine.
    verify_skippables(nn.Sequential(mix(stash=["a"]), mix(stash=["b"], pop=["a"]), mix(pop=["b"])))


def test_verify_skippables_with_namespaces():
    ns1, ns2 = Namespace(), Namespace()
    verify_skippables(nn.Sequential(Layer1().isolate(ns1), Layer3().isolate(ns1),
                                    Layer1().isolate(ns2), Layer3().isolate(ns2)))
    verify_skippables(nn.Sequential(Layer1().isolate(ns1), Layer1().isolate(ns2), Layer2(),
                                    Layer3().isolate(ns2), Layer3().isolate(ns1)))
    # A pop in another namespace than its stash matches nothing.
    assert verify_message(Layer1().isolate(ns1), Layer3()) == (
        "one or more pairs of stash and pop do not match:\n\n"
        "* '1' declared '1to3' as poppable but it was not stashed\n"
        "* no module declared '1to3' as poppable but stashed")
    # only=: 'alice' isolated, 'bob' left in the default namespace.
    ssp = mix(stash=["alice", "bob"]).isolate(ns1, only=["alice"])
    verify_skippables(nn.Sequential(ssp, mix(pop=["alice"]).isolate(ns1), mix(pop=["bob"])))
    assert "'2' declared 'bob' as poppable but it was not stashed" in verify_message(
        mix(stash=["alice", "bob"]).isolate(ns1, only=["alice"]), mix(pop=["alice"]).isolate(ns1),
        mix(pop=["bob"]).isolate(ns1))


# -- skip_routes, has_skippables ----------------------------------------------------------------

def six_layer_model() -> Tuple[nn.Sequential, List[List[nn.Module]]]:
    """Skips 'a' (stage 0 -> 1), 'c' (0 -> 2), 'b' (1 -> 2) and 'd' (within stage 1), on the
    balance [2, 2, 2]."""
    torch.manual_seed(0)
    model = nn.Sequential(mix(stash=["a", "c"]), nn.Linear(4, 4), mix(stash=["b", "d"]),
                          mix(pop=["a", "d"]), nn.Linear(4, 4), mix(pop=["b", "c"])).double()
    return model, [list(model[0:2]), list(model[2:4]), list(model[4:6])]


def test_skip_routes():
    model, parts = six_layer_model()
    verify_skippables(model)
    assert skip_routes(parts) == [Route((None, "a"), 0, 1), Route((None, "c"), 0, 2),
                                  Route((None, "b"), 1, 2)]
    # All in one stage: no routes. One layer a stage: every skip is a route.
    assert skip_routes([list(model)]) == []
    assert skip_routes([[layer] for layer in model]) == [
        Route((None, "a"), 0, 3), Route((None, "d"), 2, 3), Route((None, "c"), 0, 5),
        Route((None, "b"), 2, 5)]
    ns = Namespace()
    isolated = [[mix(stash=["x"]).isolate(ns), mix(stash=["x"])], [mix(pop=["x"])],
                [mix(pop=["x"]).isolate(ns)]]
    assert skip_routes(isolated) == [Route((None, "x"), 0, 1), Route((ns, "x"), 0, 2)]
    route = skip_routes(isolated)[0]
    assert (route.key, route.stash_stage, route.pop_stage) == ((None, "x"), 0, 1)


def test_has_skippables():
    model, parts = six_layer_model()
    assert has_skippables(model) and has_skippables(parts) and has_skippables(model[0])
    plain = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert not has_skippables(plain) and not has_skippables([list(plain)])
    # Only top-level layers count, as in torchgpipe.
    assert not has_skippables(nn.Sequential(nn.Sequential(StashSkip())))


# -- StageRunner --------------------------------------------------------------------------------

def runners_for(parts: List[List[nn.Module]]) -> List[StageRunner]:
    routes = skip_routes(parts)
    runners, first = [], 0
    for j, layers in enumerate(parts):
        runners.append(StageRunner(layers, [r.key for r in routes if r.pop_stage == j],
                                   [r.key for r in routes if r.stash_stage == j], j, first))
        first += len(layers)
    return runners


def run_by_stages(runners: List[StageRunner], x: Tensor) -> Tensor:
    """The stages one after the other, each route's tensor handed over by hand."""
    waiting: Dict[tuple, Optional[Tensor]] = {}
    for runner in runners:
        x, out = runner(x, tuple(waiting.pop(key) for key in runner.incoming))
        waiting.update(zip(runner.outgoing, out))
    assert not waiting
    return x


def test_stage_runners_equal_the_plain_model_in_float64():
    model, parts = six_layer_model()
    runners = runners_for(parts)
    assert [(r.incoming, r.outgoing) for r in runners] == [
        ([], [(None, "a"), (None, "c")]), ([(None, "a")], [(None, "b")]),
        ([(None, "c"), (None, "b")], [])]
    x = torch.randn(5, 4, dtype=torch.float64)
    reference = copy.deepcopy(model)
    x_ref = x.clone().requires_grad_()
    expected = reference(x_ref)
    expected.square().sum().backward()
    x_pipe = x.clone().requires_grad_()
    got = run_by_stages(runners, x_pipe)
    got.square().sum().backward()
    assert torch.allclose(got, expected, rtol=0, atol=TOL)
    assert torch.allclose(x_pipe.grad, x_ref.grad, rtol=0, atol=TOL)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=TOL), name
    # A recomputation (the same runners again) gives the same result.
    assert torch.equal(run_by_stages(runners, x_pipe), got)
    # Nothing stays in any tracker.
    assert not current_skip_tracker().tensors


def test_stage_runner_carries_a_none_skip():
    @skippable(stash=["n"])
    class StashNone(nn.Module):
        def forward(self, x):
            yield stash("n", None)
            return x + 1

    layers = [StashNone(), nn.Identity(), mix(pop=["n"])]
    routes = skip_routes([layers[:1], layers[1:2], layers[2:]])
    assert routes == [Route((None, "n"), 0, 2)]
    runners = runners_for([layers[:1], layers[1:2], layers[2:]])
    y, out = runners[0](torch.zeros(1, 4), ())
    assert out == (None,)
    x = torch.randn(2, 4)
    assert torch.equal(run_by_stages(runners, x), nn.Sequential(*layers)(x))


def test_stage_runner_keeps_same_stage_skips_inside():
    runner = StageRunner([StashSkip(), nn.Tanh(), PopSkip()], [], [], 0, 0)
    x = torch.randn(2, 4)
    y, out = runner(x, ())
    assert out == () and torch.equal(y, nn.Sequential(*runner.layers)(x))


def test_stage_runner_errors_name_stage_layer_and_skip():
    # Outgoing skip that no layer of the stage stashes (routes made for another balance).
    runner = StageRunner([nn.Identity(), mix(pop=["x"])], [(None, "x")], [(None, "y")], 1, 4)
    with pytest.raises(RuntimeError, match=r"^stage 1 must send skip 'y' on to a later stage, but "
                                           r"it was not stashed \(no layer of stage 1 declares it"
                                           r" as stashable\); stash it in this stage"):
        runner(torch.zeros(1, 4), (torch.zeros(1, 4),))
    # An incoming skip no layer pops.
    runner = StageRunner([nn.Identity()], [(None, "x")], [], 2, 4)
    with pytest.raises(RuntimeError, match=r"^stage 2 received skip 'x' from an earlier stage, "
                                           r"but it was not popped \(no layer of stage 2"):
        runner(torch.zeros(1, 4), (torch.zeros(1, 4),))
    # A declared stasher in another namespace than the route's key is named.
    ns = Namespace()
    runner = StageRunner([nn.Identity(), mix(stash=["y"]).isolate(ns)], [], [(None, "y")], 0, 7)
    with pytest.raises(RuntimeError, match=r"no layer of stage 0 declares it"):
        runner(torch.zeros(1, 4), ())
    runner = StageRunner([nn.Identity(), mix(stash=["y"])], [], [(None, "y")], 0, 7)
    runner(torch.zeros(1, 4), ())
    # Errors inside a layer come out as they are.
    runner = StageRunner([nn.Identity(), mix(pop=["x"])], [], [], 3, 0)
    with pytest.raises(RuntimeError, match=r"^'x' has not been stashed \(popped by Mix\)"):
        runner(torch.zeros(1, 4), ())
    with pytest.raises(ValueError, match=r"stage 3 takes 0 incoming skip\(s\) \[\], got 1"):
        runner(torch.zeros(1, 4), (None,))


def test_stage_runner_error_names_the_declaring_layer():
    # The popping layer is there but does not pop: a Skippable with a pop
    # it skips raises first; a runner whose key names a layer that declares
    # the skip in another namespace says which layer that is not.
    @skippable(pop=["x"])
    class PopsX(nn.Module):
        def forward(self, x):
            return x + (yield pop("x"))

    layer = PopsX()
    runner = StageRunner([nn.Identity(), layer], [(None, "x")], [], 1, 4)
    assert runner._declared_by((None, "x"), stashable=False) == "declared by layer 5 (PopsX)"


def test_stage_runner_drops_its_tracker_after_each_call():
    layers = [StashSkip(), PopSkip()]
    runner = StageRunner(layers, [], [], 0, 0)
    x = torch.randn(2, 4)
    seen: List[SkipTracker] = []
    layers[0].register_forward_pre_hook(lambda *_: seen.append(current_skip_tracker()))
    runner(x, ())
    runner(x, ())
    assert len(seen) == 2 and seen[0] is not seen[1] and seen[0] is not current_skip_tracker()
    ref = weakref.ref(seen[0])
    del seen[:]
    assert ref() is None


def test_stage_runner_leaks_nothing_on_error():
    @skippable(stash=["big"])
    class Fails(nn.Module):
        def forward(self, x):
            yield stash("big", x)
            raise ValueError("boom")

    t = torch.randn(4, 4)
    runner = StageRunner([Fails()], [(None, "in")], [(None, "big")], 0, 0)
    incoming = torch.randn(2)
    ref = weakref.ref(incoming)
    with pytest.raises(ValueError, match="boom"):
        runner(t, (incoming,))
    del incoming
    assert ref() is None


class Rendezvous(nn.Module):
    """Waits until every thread is inside: the runners then surely overlap."""

    def __init__(self, barrier: Optional[threading.Barrier]) -> None:
        super().__init__()
        self.barrier = barrier

    def forward(self, x):
        if self.barrier is not None:
            self.barrier.wait(timeout=30)
        return x


def test_stage_runners_on_threads_get_their_own_trackers():
    # Two threads run the same runner at once (and a third runner of another
    # stage), each with its own input and incoming skip; each gets its own back.
    barrier = threading.Barrier(3)
    runner = StageRunner([mix(stash=["s"], pop=["in"]), Rendezvous(barrier), mix(pop=["s"])],
                         [(None, "in")], [], 1, 2)
    other = StageRunner([StashSkip(), Rendezvous(barrier)], [], [(None, "skip")], 0, 0)
    inputs = [torch.randn(2, 4) for _ in range(3)]
    skips = [torch.randn(2, 4) for _ in range(3)]
    results: Dict[int, object] = {}

    def work(i: int) -> None:
        try:
            results[i] = runner(inputs[i], (skips[i],)) if i < 2 else other(inputs[i], ())
        except BaseException as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    runner.layers[1].barrier = None  # alone from here on
    for i in range(2):
        y, out = results[i]
        assert out == ()
        with use_skip_tracker(SkipTracker()):
            expected = runner(inputs[i], (skips[i],))[0]
        assert torch.equal(y, expected)
    y, out = results[2]
    assert out[0] is inputs[2]
    assert not current_skip_tracker().tensors


# -- copies ---------------------------------------------------------------------------------------

def test_deepcopy_and_pickle_of_a_model_with_skippables():
    torch.manual_seed(0)
    ns = Namespace()
    model = nn.Sequential(StashSkip(), nn.Tanh(), PopSkip(),
                          StashSkip().isolate(ns), PopSkip().isolate(ns)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    expected = model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model)),
                  torch.load(buffer, weights_only=False)):
        assert type(other[0]) is StashSkip and type(other[2]) is PopSkip
        assert type(other[0].module) is StashSkip.module_cls
        assert other[3].namespaced("skip") == (ns, "skip")
        assert torch.equal(other(x), expected)
        assert other[0].module.linear.weight.data_ptr() != model[0].module.linear.weight.data_ptr()
    assert StashSkip.module_cls.__qualname__ == "StashSkip.module_cls"


def test_gpipe_exports_skip():
    assert gpipe.skip.skippable is skippable and "skip" in gpipe.__all__
    assert set(gpipe.skip.__all__) >= {"skippable", "stash", "pop", "verify_skippables",
                                       "Namespace"}


# -- balancing ------------------------------------------------------------------------------------

def skip_model() -> nn.Sequential:
    """Skips spanning 1 layer ('near': 1 -> 2) and 3 layers ('far': 2 -> 5)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), mix(stash=["near"]), mix(stash=["far"], pop=["near"]),
                         nn.ReLU(inplace=True), nn.Linear(4, 4), mix(pop=["far"]), nn.Linear(4, 2))


@pytest.mark.parametrize("device", [CPU, torch.device("meta")])
def test_balancing_a_model_with_skips(device):
    model = skip_model()
    model[0].weight.grad = torch.full_like(model[0].weight, 3.0)
    before = copy.deepcopy(model.state_dict())
    storages = [p.data_ptr() for p in model.parameters()]
    sample = torch.randn(8, 4)
    for balance in (balance_by_time(3, model, sample, timeout=0, device=device),
                    balance_by_size(3, model, sample, chunks=2, device=device)):
        assert len(balance) == 3 and sum(balance) == len(model) and min(balance) >= 1, balance
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert [p.data_ptr() for p in model.parameters()] == storages
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 3.0))
    assert all(p.grad is None for p in list(model.parameters())[2:])
    assert not current_skip_tracker().tensors
