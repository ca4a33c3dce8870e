"""The Python Client survives anything a caller passes, and never leaves a caller waiting.

  - bad input (text that is not UTF-8, ids that are not int64, sampling values out of
    range) raises ValueError in the caller's thread; the I/O thread never sees it;
  - a message the I/O thread cannot send fails that request alone; the loop goes on;
  - an I/O thread that cannot go on marks the client dead: pending requests fail,
    later ones are refused, health() says "dead";
  - a hypothesis property over generate / stream / chat with arbitrary strings and ids:
    each call returns a result or raises ValueError / RequestFailed, and a normal request
    afterwards still gets the same tokens.
"""

from __future__ import annotations

import queue
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import save_tiny_model
from e2e_util import make_config
from protocol.messages import SamplingParams
from spec_runtime.client import Client, RequestFailed

PROMPT = [5, 17, 33, 101, 7]
SP = SamplingParams(max_tokens=4, ignore_eos=True)
# Any code point, lone surrogates and NUL included.
ANY_TEXT = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=40)
FUZZ = settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    target = save_tiny_model(tmp_path_factory.mktemp("client") / "t", "llama")
    with Client(make_config(target, mode="ar")) as c:
        yield c


@pytest.fixture(scope="module")
def reference(client):
    return client.generate(PROMPT, SP).token_ids


def _still_serves(client, reference) -> None:
    assert client.generate(PROMPT, SP).token_ids == reference
    assert client.health() == "ok"


def test_lone_surrogate_in_stop_is_refused_up_front(client, reference):
    for bad in (SamplingParams(max_tokens=4, stop=["a\ud800"]), SamplingParams(max_tokens=4, stop=["\udfff"])):
        with pytest.raises(ValueError, match="not valid UTF-8"):
            client.generate(PROMPT, bad)
    with pytest.raises(ValueError, match="not valid UTF-8"):
        client.generate("hello \ud83d world", SP)
    with pytest.raises(ValueError, match=r"messages\[0\].content is not valid UTF-8"):
        client.chat([{"role": "user", "content": "\ud800"}], SP)
    _still_serves(client, reference)


def test_values_the_wire_cannot_carry_are_refused_up_front(client, reference):
    for ids in ([2**63], [1.5], [True, 3], ["7"]):
        with pytest.raises(ValueError):
            client.generate(ids, SP)
    for sp in (SamplingParams(max_tokens=0), SamplingParams(seed=2**70), SamplingParams(top_p=float("nan"))):
        with pytest.raises(ValueError):
            client.generate(PROMPT, sp)
    _still_serves(client, reference)


def test_a_message_that_cannot_be_sent_fails_alone(client, reference):
    """A frame list zmq refuses (here: a non-buffer object) fails its own request."""
    q: queue.Queue = queue.Queue()
    with client._lock:
        client._queues["req-broken"] = q
    client._outbox.put(("req-broken", [object()]))
    err = q.get(timeout=10)
    assert isinstance(err, RequestFailed) and "could not send" in str(err)
    assert client._io.is_alive()
    _still_serves(client, reference)


def test_engine_stats_through_the_io_thread(client):
    st_ = client.engine_stats()
    assert st_.mode == "ar" and st_.num_running == 0


@FUZZ
@given(prompt=st.one_of(ANY_TEXT, st.lists(st.integers(-(2**64), 2**64), max_size=6)),
       stop=st.lists(ANY_TEXT, max_size=3), how=st.sampled_from(["generate", "stream", "chat"]))
def test_fuzz_client_calls(client, reference, prompt, stop, how):
    sp = SamplingParams(max_tokens=3, stop=stop)
    try:
        if how == "generate":
            res = client.generate(prompt, sp)
            assert len(res.token_ids) <= 3
        elif how == "stream":
            outs = list(client.stream(prompt, sp))
            assert outs and outs[-1].finished
        else:
            client.chat([{"role": "user", "content": prompt if isinstance(prompt, str) else str(prompt)}], sp)
    except (ValueError, RequestFailed):
        pass
    assert client._io.is_alive() and client.health() == "ok"
    assert client.generate(PROMPT, SP).token_ids == reference


def test_io_thread_that_cannot_go_on_marks_the_client_dead(tmp_path):
    target = save_tiny_model(tmp_path / "t", "llama")
    with Client(make_config(target, mode="ar")) as c:
        rid = c.submit(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
        got: list = []
        reader = threading.Thread(target=lambda: got.append(_drain(c, rid)))
        reader.start()
        healthy_dead_child = c.launcher.dead_child

        def broken():  # the loop's own bookkeeping fails, outside any one message
            raise RuntimeError("monitor state is corrupt")

        c.launcher.dead_child = broken
        c._io.join(timeout=10)
        assert not c._io.is_alive()
        reader.join(timeout=10)
        assert got and isinstance(got[0], RequestFailed) and "I/O thread stopped" in str(got[0])
        c.launcher.dead_child = healthy_dead_child
        assert c.health() == "dead"
        with pytest.raises(RequestFailed, match="I/O thread stopped"):
            c.submit(PROMPT, SP)
        with pytest.raises(RequestFailed, match="I/O thread stopped"):
            c.engine_stats(timeout_s=1.0)


def _drain(c: Client, rid: str):
    try:
        for _ in c.stream_outputs(rid, timeout_s=30):
            pass
    except RequestFailed as e:
        return e
    return None
