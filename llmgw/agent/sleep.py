"""
The agent's side of sleeping engines (DESIGN §22): which of its shards
sleep, and putting idle ones to sleep.

A shard sleeps when its spec says how (C{sleep_level} above 0, an engine of
L{llmgw.sleepmodes}) and it is its replica's leader. A replica spread over
several nodes sleeps and wakes as one through its leader's server, so a
follower is never watched, slept or woken on its own, whatever its spec
says, and its agent's idle look never races the leader's:

  - vLLM: C{POST /sleep} reaches C{Executor.sleep} (vllm/v1/executor/
    abstract.py), which is C{collective_rpc("sleep", kwargs=dict(level=
    level))} to every worker of the engine, those on other nodes included;
    C{wake_up} likewise. Its followers (C{--headless}, or Ray workers) serve
    no HTTP API to call;
  - SGLang: the tokenizer manager on node 0 hands
    C{ReleaseMemoryOccupationReqInput} to the scheduler of TP rank 0, whose
    C{recv_requests} broadcasts it to every TP rank over the TP CPU group
    (C{broadcast_pyobj(..., self.tp_cpu_group, src=self.tp_group.ranks[0])},
    python/sglang/srt/managers/scheduler.py); each rank then releases its
    own memory. Nodes of C{node_rank >= 1} run no tokenizer and serve only a
    dummy health check (python/sglang/srt/entrypoints/engine.py);
  - llama.cpp: the leader's server keeps its own idle timer; nothing is
    called on a follower.

The control plane reads a replica's sleep from its leader alone and counts
every shard's GPUs as reclaimable (L{llmgw.control.core.sleeping}).

About once a second, for each ready leader that sleeps, L{Sleeper}:

  - asks the engine whether it sleeps where it can say (vLLM's
    C{/is_sleeping}, llama.cpp's C{/props}); SGLang cannot, so the agent
    keeps its own word and takes requests running or tokens generated
    since it slept as the sign that a gateway woke it;
  - counts it busy while the scraper's newest figures show requests
    running or waiting, and puts it to sleep (vLLM, SGLang) once it has
    been idle for the spec's C{sleep_after_s}; llama.cpp keeps that timer
    itself (C{--sleep-idle-seconds});
  - calls C{on_change} when a shard falls asleep or wakes, so that the
    control plane hears it at once rather than at the next heartbeat.

Waking is the gateway's (L{llmgw.gateway.waking}): a request that finds
every replica asleep wakes one, and the next look here sees it awake.

The control plane may ask for a sleep at once to make room for another
model (C{SleepShard}, L{Sleeper.sleep_now}): the same call as an idle
sleep, refused with a logged reason for a shard that is not a ready,
idle leader of an engine llmgw puts to sleep. A refusal, or a sleep call
that fails, is also sent at once in the shard's next heartbeat signals
(C{sleep_refused}, L{Sleeper.take_refusal}), so that the control plane
makes room another way at once rather than when its wait runs out.

The control plane may lend a sleeping shard's GPUs to a new shard
(L{llmgw.control.core.lending}). A gateway holding a routing table from
just before the lend may still wake the sleeper, so a start on GPUs a
sleeping leader here holds waits for its engine to say, asked there and
then, that it still sleeps (L{Sleeper.confirm}), and is refused if it is
awake or cannot say. A lender seen awake while a borrower holds its GPUs
is logged as a warning (the control plane hears it at once and warns,
C{displaced_awake}).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw import sleepmodes
from llmgw.addresses import format_address
from llmgw.agent.scrape import Scraper
from llmgw.agent.shard import FAILED, STOPPED, Shard
from llmgw.agent.state import ShardSpec
from llmgw.agent.supervisor import Supervisor
from llmgw.periodic import Periodic
from llmgw.states import ShardState

#: Seconds between looks.
SLEEP_INTERVAL = 1.0
#: Seconds a sleeping engine has to say whether it still sleeps before a
#: start on its GPUs goes ahead; without an answer the start is refused.
CONFIRM_TIMEOUT_S = 5.0


@dataclass
class SleepState:
    """
    What the agent knows of one shard's sleep: whether it sleeps (C{None}
    before the first answer), when it was last seen busy, whether a call
    is in flight, and its generated-token count when it fell asleep.
    """

    busy_at: float
    sleeping: bool | None = None
    calling: bool = False
    tokens_at_sleep: float | None = None
    slept_at: float = 0.0


class Sleeper(Periodic):
    """
    Watches and sleeps the supervisor's sleeping-capable shards (see the
    module). C{call(method, url, body)} makes an HTTP call and fires with
    the body of a 200 (L{llmgw.agent.scrape.HttpFetcher.call}).
    """

    log = Logger()
    failed = "a pass over the sleeping engines failed; the next one goes on"

    def __init__(
        self,
        clock: Any,
        supervisor: Supervisor,
        scraper: Scraper,
        call: Callable[[bytes, str, bytes | None], defer.Deferred[bytes]],
        host: Callable[[], str] = lambda: "127.0.0.1",
        interval: float = SLEEP_INTERVAL,
    ):
        self.clock = clock
        self.supervisor = supervisor
        self.scraper = scraper
        self.call = call
        self.host = host
        self.interval = interval
        self.states: dict[str, SleepState] = {}
        #: Called with a shard id when it fell asleep or woke, or a sleep
        #: the control plane asked for was refused or failed.
        self.on_change: Callable[[str], None] = lambda shard_id: None
        #: Why a sleep the control plane asked for did not happen, by
        #: shard, until a heartbeat takes it (L{take_refusal}).
        self.refused: dict[str, str] = {}
        #: The starts waiting for their lenders' engines (L{confirm}).
        self.confirming: dict[str, ShardSpec] = {}

    def state_of(self, shard_id: str) -> tuple[bool | None, str]:
        """
        Whether C{shard_id} sleeps (C{None}: it does not sleep, or is not
        known yet) and the path that wakes it ("": a request does).
        """
        st = self.states.get(shard_id)
        record = self.supervisor.shards.get(shard_id)
        mode = sleepmodes.mode(record.spec.engine) if record is not None else None
        if st is None or mode is None:
            return None, ""
        return st.sleeping, mode.wake_path

    def lends(self, shard: Shard) -> bool:
        """
        Whether C{shard}'s GPUs may be shared with a new shard: a leader
        seen asleep here, or a shard of another rank of an engine that
        sleeps, whose sleep only its leader's node sees (the control plane
        lends its GPUs only while that leader reports it asleep). A shard
        awake, or whose engine never sleeps, shares nothing.
        """
        spec = shard.spec
        if spec.sleep_level <= 0 or sleepmodes.mode(spec.engine) is None or shard.stopping:
            return False
        if spec.rank != 0:
            return True
        st = self.states.get(spec.shard_id)
        return st is not None and st.sleeping is True

    def tick(self) -> None:
        now = self.clock.seconds()
        seen = set()
        for shard in self.supervisor.live_shards():
            spec = shard.spec
            mode = sleepmodes.mode(spec.engine)
            # A follower (rank above 0) sleeps with its leader (see the module):
            # one slept or woken on its own would leave its ranks out of step.
            if (mode is None or spec.sleep_level <= 0 or spec.rank != 0 or shard.state != ShardState.READY
                    or shard.stopping):
                continue
            seen.add(spec.shard_id)
            st = self.states.get(spec.shard_id)
            if st is None:
                st = self.states[spec.shard_id] = SleepState(busy_at=now)
            self._look(spec.shard_id, spec.port, spec.engine, spec.sleep_level, spec.sleep_after_s, mode, st, now)
        for gone in [s for s in self.states if s not in seen]:
            del self.states[gone]
        for gone in [s for s in self.refused if s not in self.supervisor.shards]:
            del self.refused[gone]

    def _look(self, shard_id: str, port: int, engine: str, level: int, after: float,
              mode: sleepmodes.SleepMode, st: SleepState, now: float) -> None:
        sample = self.scraper.samples.get(shard_id)
        sig = sample.signals if sample is not None else None
        busy = sig is not None and ((sig.running or 0) > 0 or (sig.waiting or 0) > 0)
        if busy and sig is not None and sig.sampled_at > st.slept_at:
            st.busy_at = now
        if st.calling:
            return
        base = f"http://{format_address(self.host(), port)}"
        if not mode.status_path:
            if st.sleeping is None:
                # An engine that cannot say starts awake.
                st.sleeping = False
            elif self._woken(shard_id, st):
                self._set(shard_id, st, False, now)
        idle = sig is not None and sig.running is not None and not busy
        if (mode.sleep_path and st.sleeping is False and after > 0 and idle
                and now - st.busy_at >= after):
            self._sleep(shard_id, engine, base + mode.sleep_path.format(level=level), st, now - st.busy_at)
        elif mode.status_path:
            self._ask(shard_id, engine, base + mode.status_path, st)

    def _woken(self, shard_id: str, st: SleepState) -> bool:
        """
        Whether an engine that cannot say it sleeps (SGLang), asleep by the
        agent's word, was woken: the scraper's newest figures, newer than
        its sleep, show requests or tokens generated since.
        """
        sample = self.scraper.samples.get(shard_id)
        sig = sample.signals if sample is not None else None
        return bool(st.sleeping and sig is not None and sig.sampled_at > st.slept_at and (
            (sig.running or 0) > 0 or (sig.waiting or 0) > 0
            or (sig.generated_tokens or 0) > (st.tokens_at_sleep or 0)))

    def _set(self, shard_id: str, st: SleepState, sleeping: bool, now: float) -> None:
        if st.sleeping == sleeping:
            return
        was, st.sleeping = st.sleeping, sleeping
        if was and not sleeping:
            self._warn_if_lent(shard_id)
        if sleeping:
            st.slept_at = now
        else:
            # Just woken: the request that woke it is on its way, so the
            # idle timer starts again rather than putting it back to sleep.
            st.busy_at = now
        if was is not None:
            self.log.info("shard {shard} is {what}", shard=shard_id, what="asleep" if sleeping else "awake")
            self.on_change(shard_id)

    def _ask(self, shard_id: str, engine: str, url: str, st: SleepState) -> None:
        st.calling = True

        def answered(body: bytes) -> None:
            st.calling = False
            try:
                sleeping = sleepmodes.read_status(engine, body)
            except ValueError as e:
                self.log.warn("shard {shard}: {error}", shard=shard_id, error=str(e))
                return
            self._set(shard_id, st, sleeping, self.clock.seconds())

        def failed(f: Failure) -> None:
            # A failed look leaves the state as it was; the next pass asks again.
            st.calling = False

        self.call(b"GET", url, None).addCallbacks(answered, failed)

    def _sleep(self, shard_id: str, engine: str, url: str, st: SleepState, idle_for: float,
               asked: bool = False) -> None:
        st.calling = True
        sample = self.scraper.samples.get(shard_id)
        tokens = sample.signals.generated_tokens if sample is not None and sample.signals is not None else None

        def done(_: bytes) -> None:
            st.calling = False
            st.tokens_at_sleep = tokens
            self.log.info("shard {shard}: idle for {idle:.1f}s, its engine is put to sleep",
                          shard=shard_id, idle=idle_for)
            self._set(shard_id, st, True, self.clock.seconds())

        def failed(f: Failure) -> None:
            st.calling = False
            # Not again at once: a refusal (sleep mode off) would repeat every second.
            st.busy_at = self.clock.seconds()
            self.log.warn("shard {shard}: putting its engine to sleep failed: {why}; tried again after "
                          "the next idle period", shard=shard_id, why=f.getErrorMessage())
            if asked:
                self._refuse(shard_id, f"its engine's sleep call failed: {f.getErrorMessage()}")

        self.call(b"POST", url, sleepmodes.sleep_body(engine)).addCallbacks(done, failed)

    def sleep_now(self, shard_id: str) -> str | None:
        """
        Put C{shard_id}'s engine to sleep now, as the control plane asks
        (C{SleepShard}) to make room, through the same call as an idle
        sleep; C{None} when the call is made (or it sleeps already), else
        why not, which is logged: an unknown shard, one that is not a ready
        leader of an engine llmgw puts to sleep, or one busy (requests
        running or waiting by the newest figures, or a call to its engine
        under way). The control plane learns the outcome from the shard's
        signals in the heartbeat sent at once: asleep, or why not
        (L{take_refusal}), a failed call to its engine included.
        """
        why = self._refusal(shard_id)
        if why is not None:
            self.log.warn("not putting shard {shard} to sleep as the control plane asked: {why}",
                          shard=shard_id, why=why)
            if shard_id in self.supervisor.shards:
                # (Of a shard that does not run here its status says more.)
                self._refuse(shard_id, why)
            return why
        return None

    def _refuse(self, shard_id: str, why: str) -> None:
        self.refused[shard_id] = why
        self.on_change(shard_id)

    def take_refusal(self, shard_id: str) -> str:
        """
        Why the sleep the control plane last asked of C{shard_id} did not
        happen, once (the heartbeat that carries it takes it); "" when
        nothing is to be told.
        """
        return self.refused.pop(shard_id, "")

    def _refusal(self, shard_id: str) -> str | None:
        shard = self.supervisor.shards.get(shard_id)
        if shard is None or shard.stopping:
            return "no such shard runs here"
        spec = shard.spec
        mode = sleepmodes.mode(spec.engine)
        if mode is None or not mode.sleep_path or spec.sleep_level <= 0 or spec.rank != 0:
            return (f"its engine ({spec.engine}, rank {spec.rank}, sleep level {spec.sleep_level}) is not "
                    "one llmgw puts to sleep: a leader of vLLM or SGLang with a sleep level")
        if shard.state != ShardState.READY:
            return f"it is {shard.state}, not ready"
        now = self.clock.seconds()
        st = self.states.get(shard_id)
        if st is None:
            st = self.states[shard_id] = SleepState(busy_at=now)
        if st.sleeping:
            return None
        sample = self.scraper.samples.get(shard_id)
        sig = sample.signals if sample is not None else None
        if sig is None or sig.running is None:
            return "busy: no figures of its requests in flight yet"
        if (sig.running or 0) > 0 or (sig.waiting or 0) > 0:
            return f"busy: {sig.running:g} request(s) running, {sig.waiting or 0:g} waiting"
        if st.calling:
            return "busy: a call to its engine is under way"
        if st.sleeping is None:
            # An engine that cannot say whether it sleeps starts awake.
            st.sleeping = False
        base = f"http://{format_address(self.host(), spec.port)}"
        self._sleep(shard_id, spec.engine, base + mode.sleep_path.format(level=spec.sleep_level), st,
                    now - st.busy_at, asked=True)
        return None

    def confirm(self, spec: ShardSpec, held: list[Shard]) -> bool:
        """
        Before C{spec} starts on GPUs that a sleeping leader here holds
        (lent by the control plane), ask that engine now whether it still
        sleeps rather than trust the last look. True when the start waits
        for the answers: the supervisor then starts it once every such
        engine says it sleeps, or refuses it, with the reason, when one is
        awake or cannot say (an error, no answer within
        L{CONFIRM_TIMEOUT_S}). A start reported stopped meanwhile
        (L{reported}) is not started. False: nothing to ask.
        """
        gpus = set(spec.gpu_indices)
        lenders = [s for s in held
                   if s.spec.rank == 0 and not gpus.isdisjoint(s.spec.gpu_indices) and self.lends(s)]
        if not lenders:
            return False
        if spec.shard_id in self.confirming:
            self.log.info("shard {shard}: its lenders' engines are being asked already", shard=spec.shard_id)
            return True
        self.confirming[spec.shard_id] = spec
        self.log.info("shard {shard} shares GPUs with sleeping shard(s) {lenders}: asking whether they "
                      "still sleep before it starts", shard=spec.shard_id,
                      lenders=", ".join(s.shard_id for s in lenders))
        d = defer.gatherResults([self._still_asleep(s, gpus) for s in lenders])
        d.addCallback(self._confirmed, spec)
        d.addErrback(lambda f: self.log.failure("confirming shard {shard}'s lenders failed", f,
                                                shard=spec.shard_id))
        return True

    def reported(self, shard: Shard) -> None:
        """
        A supervisor's report: a start waiting for its lenders' engines and
        reported stopped or failed meanwhile (a stop came) is dropped.
        """
        if shard.state in (STOPPED, FAILED) and self.confirming.pop(shard.shard_id, None) is not None:
            self.log.info("shard {shard} is {state} before its lenders' engines answered; not started",
                          shard=shard.shard_id, state=shard.state)

    def _confirmed(self, problems: list[str | None], spec: ShardSpec) -> None:
        if self.confirming.pop(spec.shard_id, None) is None:
            return
        problem = next((p for p in problems if p), None)
        if problem is not None:
            self.supervisor.refuse(spec, problem)
        else:
            self.supervisor.start(spec, confirmed=True)

    def _still_asleep(self, lender: Shard, gpus: set[int]) -> defer.Deferred[str | None]:
        """
        Fires with why a start on C{gpus} may not go ahead beside sleeping
        C{lender}, or C{None} when its engine says it still sleeps.
        """
        spec, sid = lender.spec, lender.shard_id
        shared = ",".join(map(str, sorted(gpus & set(spec.gpu_indices))))
        awake = (f"GPU {shared} is in use by shard {sid}, whose engine is awake (asked just now): a request "
                 "woke it after the control plane lent its memory")
        mode = sleepmodes.mode(spec.engine)
        st = self.states.get(sid)
        if mode is None or st is None:
            return defer.succeed(f"GPU {shared} is in use by shard {sid}, not known to sleep")
        if not mode.status_path:
            # SGLang cannot say: the agent's own word, with its newest figures.
            if self._woken(sid, st):
                self._set(sid, st, False, self.clock.seconds())
                return defer.succeed(awake)
            return defer.succeed(None)
        d = self.call(b"GET", f"http://{format_address(self.host(), spec.port)}{mode.status_path}", None)
        d.addTimeout(CONFIRM_TIMEOUT_S, self.clock)

        def answered(body: bytes) -> str | None:
            if sleepmodes.read_status(spec.engine, body):
                return None
            self._set(sid, st, False, self.clock.seconds())
            return awake

        def failed(f: Failure) -> str:
            why = (f"no answer within {CONFIRM_TIMEOUT_S:g}s" if f.check(defer.TimeoutError)
                   else f.getErrorMessage())
            return (f"GPU {shared} is in use by sleeping shard {sid}, whose engine could not say whether "
                    f"it still sleeps ({why})")

        return d.addCallback(answered).addErrback(failed)

    def _warn_if_lent(self, shard_id: str) -> None:
        """
        C{shard_id} woke: a warning if another shard here runs on its GPUs
        (a borrower), as two engines now share them.
        """
        record = self.supervisor.shards.get(shard_id)
        if record is None:
            return
        gpus = set(record.spec.gpu_indices)
        others = [s.shard_id for s in self.supervisor.live_shards()
                  if s.shard_id != shard_id and not gpus.isdisjoint(s.spec.gpu_indices)]
        if others:
            self.log.warn("shard {shard} woke while its GPUs {gpus} are lent to shard(s) {others}: two "
                          "engines share them, and one may run out of memory", shard=shard_id,
                          gpus=",".join(map(str, sorted(gpus))), others=", ".join(others))
