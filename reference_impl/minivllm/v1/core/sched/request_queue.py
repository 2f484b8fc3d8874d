"""The waiting queue, in the order the scheduling policy gives (vLLM's
`vllm/v1/core/sched/request_queue.py`).

"fcfs": arrival order, with preempted requests put back at the front.
"priority": the order of `Request.__lt__`: lowest `priority` value first,
then earliest arrival, then `request_id` in string order; a preempted
request simply goes back in, and its order puts it where it was.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Iterable, Iterator

from minivllm.v1.request import Request


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class FCFSRequestQueue(deque):
    """A deque: add at the back, take from the front, preempted to the front."""

    def add_request(self, request: Request) -> None:
        self.append(request)

    def pop_request(self) -> Request:
        return self.popleft()

    def peek_request(self) -> Request:
        if not self:
            raise IndexError("peek from an empty queue")
        return self[0]

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        self.extendleft(reversed(list(requests)))

    def remove_request(self, request: Request) -> None:
        self.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = set(map(id, requests))
        kept = [r for r in self if id(r) not in gone]
        self.clear()
        self.extend(kept)


class PriorityRequestQueue:
    """A heap of requests, ordered by `Request.__lt__` (priority, then
    arrival_time, then request_id), as vLLM's is."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0]

    # Order is the requests' own: "prepending" is adding.
    prepend_request = add_request

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self.remove_requests([request])

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = set(map(id, requests))
        self._heap = [r for r in self._heap if id(r) not in gone]
        heapq.heapify(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In scheduling order."""
        return iter(sorted(self._heap))


def create_request_queue(policy: SchedulingPolicy) -> FCFSRequestQueue | PriorityRequestQueue:
    return FCFSRequestQueue() if policy == SchedulingPolicy.FCFS else PriorityRequestQueue()
