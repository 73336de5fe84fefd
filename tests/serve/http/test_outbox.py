"""The outbox between the engine thread and the event loop: a step's outputs arrive in order, in their own queues,
for one wake-up of the loop; once the loop is closed a put raises, so that the engine aborts the request."""

import asyncio
import threading

import pytest

from serve.http.outbox import Outbox, outbox_of


def test_a_steps_outputs_arrive_in_order_for_one_wake_up():
    loop = asyncio.new_event_loop()
    wake_ups = []
    call_soon_threadsafe = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *args: wake_ups.append(args) or call_soon_threadsafe(*args)
    queues = [asyncio.Queue() for _ in range(3)]
    outbox = outbox_of(loop)
    assert outbox_of(loop) is outbox

    def engine_step(step):
        for i in range(30):
            outbox.put(queues[i % 3], (step, i))

    async def read(count):
        return [[await q.get() for _ in range(count)] for q in queues]

    for step in range(2):  # each step's puts land before the loop runs: one wake-up per step
        engine = threading.Thread(target=engine_step, args=(step,))
        engine.start()
        engine.join()
        got = loop.run_until_complete(read(10))
        assert got == [[(step, i) for i in range(q, 30, 3)] for q in range(3)]
        assert len(wake_ups) == step + 1
    loop.close()


def test_a_put_after_the_loop_closed_raises():
    loop = asyncio.new_event_loop()
    outbox = Outbox(loop)
    queue = asyncio.Queue()
    outbox.put(queue, "before")
    loop.close()
    with pytest.raises(RuntimeError):
        outbox.put(queue, "after")
