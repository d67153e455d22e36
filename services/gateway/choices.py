"""The generations of one HTTP request that asked for several choices (OpenAI's `n`, or a batch
of prompts): each choice is a `Pipeline.run` of its own — its own verifier request, span and
metrics — and `Choices` runs them side by side, one task each, and hands their events on in the
order they arrive, tagged with the choice's index.

`start()` waits until every choice has its first event (so the response's HTTP status is known)
or raises the first error instead; `events()` then yields (index, event) — the held first events,
then the rest — until every choice has sent its final, raising the first error a choice ends in.
`aclose()` cancels the choices still generating — each one's verifier call is cancelled and
its request freed there, as when a client disconnects — and waits for the finished ones to end
their verifier call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from services.gateway.convert import GatewayFinal
from services.gateway.pipeline import GenerationFailed

_END = object()  # a choice's stream ended


class Choices:
    """`n`: choices per prompt (choice k is prompt k // n's); with several choices, an error's
    message names whose it is."""

    def __init__(self, streams: list[AsyncIterator], n: int = 1) -> None:
        self._labels = None if len(streams) == 1 else [
            f"prompt {k // n}" + (f", choice {k % n}" if n > 1 else "")
            for k in range(len(streams))]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.ensure_future(self._pump(k, s)) for k, s in enumerate(streams)]
        self._held: list[tuple[int, object]] = []
        self._finished: set[int] = set()  # choices whose final was sent

    async def _pump(self, k: int, stream: AsyncIterator) -> None:
        event = None
        try:
            async for event in stream:
                self._queue.put_nowait((k, event))
                if isinstance(event, GatewayFinal):
                    self._finished.add(k)
        except Exception as e:  # noqa: BLE001 — the consumer raises it
            self._queue.put_nowait((k, e))
        else:
            if not isinstance(event, GatewayFinal):
                self._queue.put_nowait((k, _END))

    async def _next(self) -> tuple[int, object]:
        k, item = await self._queue.get()
        if isinstance(item, GenerationFailed) and self._labels:
            raise GenerationFailed(item.code, f"{item.message} ({self._labels[k]})")
        if isinstance(item, Exception):
            raise item
        if item is _END:  # a generation that ended without its final
            raise GenerationFailed(grpc.StatusCode.INTERNAL,
                                   "the generation ended without a result")
        return k, item

    async def start(self) -> None:
        """Until every choice has its first event; raises the first error instead."""
        firsts: set[int] = set()
        while len(firsts) < len(self._tasks):
            k, event = await self._next()
            self._held.append((k, event))
            firsts.add(k)

    async def events(self) -> AsyncIterator[tuple[int, object]]:
        """(choice, TextChunk | GatewayFinal) as they come, until every choice's final."""
        finals = 0
        while finals < len(self._tasks):
            k, event = self._held.pop(0) if self._held else await self._next()
            finals += isinstance(event, GatewayFinal)
            yield k, event

    async def aclose(self) -> None:
        """Cancel the choices still generating; let the finished ones end their verifier call
        (a stop string's `Stop`, then the cancel: services/gateway/pipeline.py)."""
        for k, task in enumerate(self._tasks):
            if k not in self._finished:
                task.cancel()
        # shielded: a caller cancelled meanwhile (its client gone) leaves them to end alone
        await asyncio.shield(asyncio.gather(*self._tasks, return_exceptions=True))
