"""In-process integrity of a timed run: what the legs rest on, read before and after each one.

``Watch`` notes, when the run begins, the determinism settings, the default dtype, the clock and
its ``time.perf_counter``, the functions and classes of the harness and of the stream's writer, the torch calls they rest on, the control decoder's class and bound
``decode``, and the interpreter's state the legs run under (``Runtime``: trace and profile hooks,
sys.monitoring tools, the live threads and the switch interval, the garbage collector's settings
and callbacks, signal handlers and interval timers, torch's thread counts). It re-reads them after
both decoders' ``prepare()``, after each warm-up and after every leg, and compares the records it
has made for the prompt (the leg records, the violations) with its own copy of each; each change
becomes a ``violation`` record, which fails the audit.

Every reading is compared with the run's start, whichever leg ran last, so a change the candidate
makes inside its own decode and undoes before returning is invisible (its own leg pays for it),
and one it leaves behind is a violation before the next leg, the control's included. A thread the
candidate starts must end inside its decode: any thread alive after a leg that was not alive when
the run began is a violation (a decoder's helper threads live and die within its decode). Threads
that end are not: ending a thread slows nothing.

What a decoder sharing this process can still do: change something inside its own decode and
restore it before returning; reach the checker itself, or state no reading sees (the shared
model's modules and their hooks, a library's internals, objects already bound in a running frame,
audit hooks, which Python cannot list, a finaliser of its own garbage that the collector runs
during the control's leg); and precompute answers for any prompt set it can load by itself (the
built-in sets). The answer to all of that is ``audit retime``: fresh prompts the stream never
held, the candidate and the control each in a process of its own, timed by the audit's clock.
"""
from __future__ import annotations

import gc
import operator
import pkgutil
import _signal
import signal
import sys
import threading

import torch

from core import determinism
from harness.clock import Clock

# module:attribute paths of single objects the timing rests on, re-resolved at every check
WATCHED = ("time:perf_counter", "torch.cuda:synchronize", "torch.cuda:reset_peak_memory_stats",
           "torch.cuda:max_memory_allocated")


def watched_modules() -> tuple[str, ...]:
    """Every module of the harness package, found by walking it (so that moving code between its
    modules cannot shrink the list), and the stream's schema and determinism settings."""
    import harness  # this package: its path is what is walked

    found = sorted(info.name for info in pkgutil.walk_packages(harness.__path__, "harness."))
    return ("harness", *found, "core.schema", "core.determinism")


# modules whose every function and class (and each of their classes' attributes) the timing and
# the writing of the stream rest on; a module not loaded when the run begins is skipped
WATCHED_MODULES = watched_modules()


def resolve(path: str):
    module, _, attr = path.partition(":")
    return getattr(sys.modules[module], attr, None)


def class_attributes(cls: type) -> dict[tuple[str, str], object]:
    """Every attribute defined on ``cls`` and its bases (``object`` aside), by (class, name)."""
    return {(klass.__qualname__, name): value for klass in cls.__mro__[:-1] for name, value in vars(klass).items()}


def module_objects() -> dict[str, object]:
    """By dotted name: every callable of the watched modules, and every attribute of the classes
    they define."""
    out = {}
    for name in WATCHED_MODULES:
        module = sys.modules.get(name)
        for attr, value in (vars(module).items() if module is not None else ()):
            if callable(value):
                out[f"{name}.{attr}"] = value
            if isinstance(value, type) and value.__module__ == name:
                out.update({f"{name}.{k[0]}.{k[1]}": v for k, v in class_attributes(value).items()})
    return out


def plain_copy(value):
    """A copy of a JSON-shaped record whose containers are new and whose scalars are the same
    objects (so an unchanged NaN still compares equal to itself)."""
    if type(value) is dict:
        return {k: plain_copy(v) if type(v) in (dict, list) else v for k, v in value.items()}
    if type(value) is list:
        return [plain_copy(v) if type(v) in (dict, list) else v for v in value]
    return value


ITIMERS = tuple(getattr(signal, name) for name in ("ITIMER_REAL", "ITIMER_VIRTUAL", "ITIMER_PROF")
                if hasattr(signal, name))


class Runtime:
    """Cheap readings of the interpreter state every leg runs under (a few microseconds in all).
    The reading functions are held from the moment the run began, so that replacing
    ``sys.gettrace`` and the like cannot blind the check."""

    def __init__(self):
        self._gettrace, self._getprofile = sys.gettrace, sys.getprofile
        self._thread_trace, self._thread_profile = threading.gettrace, threading.getprofile
        self._monitoring = getattr(sys, "monitoring", None)  # 3.12+
        self._enumerate, self._frames, self._switch = threading.enumerate, sys._current_frames, sys.getswitchinterval
        self._gc = (gc.isenabled, gc.get_threshold, gc.get_freeze_count)
        self._gc_callbacks = gc.callbacks  # the collector's own list (rebinding gc.callbacks does not replace it)
        # the C function (signal.getsignal wraps each answer in an enum: ten times slower)
        self._getsignal, self._getitimer = _signal.getsignal, getattr(signal, "getitimer", None)
        self._signals = tuple(signal.valid_signals()) if hasattr(signal, "valid_signals") else ()
        self._torch_threads = (torch.get_num_threads, torch.get_num_interop_threads)
        self.start = self.read()
        self.threads = self.thread_set()

    def read(self) -> dict:
        """Everything but the threads, each as a value compared with ``==`` (hooks by identity)."""
        isenabled, threshold, frozen = self._gc
        out = {
            "sys.settrace hook": HookId(self._gettrace()),
            "sys.setprofile hook": HookId(self._getprofile()),
            "threading.settrace hook": HookId(self._thread_trace()),
            "threading.setprofile hook": HookId(self._thread_profile()),
            "the thread switch interval": self._switch(),
            "gc enabled": isenabled(),
            "gc thresholds": threshold(),
            "gc frozen objects": frozen(),
            "gc callbacks": HookId(*self._gc_callbacks),
            "torch intra-op threads": self._torch_threads[0](),
            "torch inter-op threads": self._torch_threads[1](),
            "signal handlers": HookId(*map(self._getsignal, self._signals)),
        }
        if self._getitimer is not None:  # (armed, interval) per timer: the delay left counts down
            out["interval timers"] = tuple((bool(delay), interval) for delay, interval in map(self._getitimer, ITIMERS))
        mon = self._monitoring
        if mon is not None:
            out["sys.monitoring tools"] = tuple((mon.get_tool(i), mon.get_events(i)) for i in range(6))
        return out

    def thread_set(self) -> set[tuple[int, str]]:
        """Every live Python thread as (ident, label): threading's (with name and daemon flag) and
        any other thread that runs Python code (``_thread.start_new_thread``), from its frame. Such
        a thread has no frame before it first holds the GIL, so it shows from the first check after
        it began to run: after the leg it first slowed."""
        named = {t.ident: f"thread {t.name!r} ({'daemon' if t.daemon else 'non-daemon'})"
                 for t in self._enumerate() if t.ident is not None}
        return {(ident, named.get(ident, f"thread {ident} (not a threading.Thread)"))
                for ident in self._frames().keys() | named.keys()}

    def problems(self) -> list[str]:
        now, out = self.read(), []
        for key, value in self.start.items():
            if now.get(key) != value:
                out.append(f"{key} changed: the run began with {describe(value)}, now {describe(now.get(key))}")
        new_threads = sorted(self.thread_set() - self.threads)
        out += [f"{label} is alive, started since the run began" for _, label in new_threads]
        return out


class HookId:
    """Hooks compared by identity, in order (a callable object's ``__eq__`` is the candidate's)."""

    __slots__ = ("objs",)

    def __init__(self, *objs):
        self.objs = objs

    def __eq__(self, other):
        return (isinstance(other, HookId) and len(other.objs) == len(self.objs)
                and all(map(operator.is_, self.objs, other.objs)))

    def __repr__(self):
        names = [repr(o) if o is None or isinstance(o, int) else getattr(o, "__qualname__", type(o).__qualname__)
                 for o in self.objs]
        return names[0] if len(names) == 1 else f"[{', '.join(names)}]"


def describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def record_label(rec) -> str:
    if isinstance(rec, dict) and rec.get("type") == "leg":
        return f"leg {rec.get('role')}#{rec.get('leg')} of prompt {rec.get('prompt_id')}"
    return f"a {rec.get('type')} record" if isinstance(rec, dict) else "a non-record"


def differs(a, b) -> bool:
    return a is not b and a != b


def record_changes(held: list, own: list[dict]) -> str | None:
    """What differs between the records a caller holds and the harness's own copies; None when
    they are the same."""
    if held == own:
        return None
    i = next((i for i, (a, b) in enumerate(zip(held, own)) if differs(a, b)), None)
    if i is None:  # named by the last record the harness made, so that each prompt's report is its own
        after = f", the last {record_label(own[-1])}" if own else ""
        return f"{len(held)} records where the harness made {len(own)}{after}"
    a, b = held[i], own[i]
    fields = sorted(k for k in (a.keys() | b.keys()) if differs(a.get(k), b.get(k))) if isinstance(a, dict) else []
    return f"record {i} ({record_label(b)}) changed" + (f": {', '.join(map(str, fields))}" if fields else "")


class Watch:
    """What a run's timing rests on, as it was when the run began. ``check(at)`` returns a
    violation record for every change since, each problem once."""

    def __init__(self, settings: dict, clock: Clock):
        self.settings = dict(settings)
        self.dtype = torch.get_default_dtype()
        self.clock = clock
        self.clock_state = (type(clock), clock.origin, clock.counter, Clock.now)
        self.objects = {path: resolve(path) for path in WATCHED}
        self.modules = module_objects()
        self.control = None
        self.control_state = None
        self.runtime = Runtime()
        self.ledger: list[dict] = []  # copies of the records made for the current prompt
        self.reported: set[str] = set()
        # held here, so that a patch of the module functions cannot blind the check itself
        self._current, self._differences, self._dtype = determinism.current, determinism.differences, torch.get_default_dtype

    def watch_control(self, control) -> None:
        """Note the control decoder before any decoder is prepared: its class, every attribute of
        its class, and the function its ``decode`` is bound to."""
        decode = control.decode
        self.control = control
        self.control_state = (type(control), class_attributes(type(control)), getattr(decode, "__func__", decode))

    def problems(self, clock: Clock | None = None) -> list[str]:
        out = [f"determinism setting {d}" for d in self._differences(self.settings, self._current())]
        if self._dtype() != self.dtype:
            out.append(f"default dtype is {self._dtype()}, the run began with {self.dtype}")
        for path, obj in self.objects.items():
            if resolve(path) is not obj:
                out.append(f"{path.replace(':', '.')} was replaced")
        now = module_objects()
        out += [f"{name} was replaced" for name in sorted(now.keys() | self.modules.keys())
                if now.get(name) is not self.modules.get(name)]
        own = self.clock
        if (type(own), own.origin, own.counter, Clock.now) != self.clock_state:
            out.append("the run's clock was altered")
        if clock is not None and clock is not own:
            out.append("the legs were timed by another clock than the run's")
        if self.control is not None:
            out += self.control_problems()
        return out + self.runtime.problems()

    def control_problems(self) -> list[str]:
        cls, attrs, decode_func = self.control_state
        control, out = self.control, []
        if type(control) is not cls:
            out.append(f"the control decoder's class is now {type(control).__qualname__}, not {cls.__qualname__}")
        now = class_attributes(cls)
        changed = sorted(f"{k[0]}.{k[1]}" for k in now.keys() | attrs.keys() if now.get(k) is not attrs.get(k))
        if changed:
            out.append(f"the control decoder's class attributes changed: {', '.join(changed)}")
        decode = control.decode
        if getattr(decode, "__func__", None) is not decode_func or getattr(decode, "__self__", None) is not control:
            out.append("the control decoder's decode is no longer its class's method")
        return out

    def begin_records(self) -> None:
        """A new list of records starts (one prompt's): the copies of the last one are dropped."""
        self.ledger = []

    def note_record(self, rec: dict) -> None:
        """Keep the harness's own copy of a record it just made, before any decoder runs again."""
        self.ledger.append(plain_copy(rec))

    def check(self, at: str, clock: Clock | None = None, records: list | None = None) -> list[dict]:
        """Violation records for every problem not reported before; with ``records`` (the list
        the caller holds and will write), also for any difference from the harness's copies of
        them. The violations returned are noted as records too: the caller appends them."""
        problems = self.problems(clock)
        if records is not None:
            changed = record_changes(records, self.ledger)
            if changed:
                problems.append(f"the harness's records were edited after it made them: {changed}")
        new = [p for p in problems if p not in self.reported]
        self.reported.update(new)
        out = [{"type": "violation", "at": at, "problem": p} for p in new]
        if records is not None:
            for rec in out:
                self.note_record(rec)
        return out
