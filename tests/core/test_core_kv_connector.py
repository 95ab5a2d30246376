"""The scheduler's side of the KV connector interface, with a recording connector (no torch)."""
from __future__ import annotations

from pagedllm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata

from core_helpers import FakeRunner, make_req, make_sched


class RecordingConnector(KVConnectorBase_V1):
    """Offers ``offer`` tokens past the device hit for every request; records every call."""

    def __init__(self, offer: int) -> None:
        super().__init__(None, None, None)
        self.offer = offer
        self.calls: list[tuple] = []
        self.pending = False

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = min(self.offer, (request.num_tokens - 1) // 4 * 4 - num_computed_tokens)
        self.calls.append(("match", request.request_id, num_computed_tokens, n))
        return max(n, 0), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.calls.append(("alloc", request.request_id, [b.block_id for b in blocks], num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        meta = KVConnectorMetadata()
        self.calls.append(("meta", id(meta)))
        self.pending = False
        return meta

    def update_connector_output(self, connector_output):
        self.calls.append(("output", connector_output))

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id, list(block_ids)))
        self.pending = True
        return False, None

    def has_pending_work(self):
        return self.pending


def test_external_tokens_are_allocated_and_marked_computed():
    conn = RecordingConnector(offer=8)
    sched = make_sched(connector=conn)
    req = make_req("a", 14, max_tokens=2)
    sched.add_request(req)
    runner = FakeRunner()
    out = sched.schedule()
    assert out.kv_connector_metadata is not None and ("meta", id(out.kv_connector_metadata)) in conn.calls
    assert conn.calls[0] == ("match", "a", 0, 8)
    [sr] = out.scheduled
    assert (sr.start_pos, sr.num_tokens) == (8, 6)  # 8 loaded, the rest computed
    table = sched.kv_cache_manager.get_block_ids("a")
    assert len(table) == 4
    assert ("alloc", "a", table[:2], 8) in conn.calls
    assert req.num_cached_tokens == 8
    assert out.total_num_scheduled_tokens == 6  # loaded tokens are not charged to the budget
    sched.update_from_output(out, runner.execute(out))
    assert ("output", None) in conn.calls
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))  # second token: finished
    fin = [c for c in conn.calls if c[0] == "finished"]
    assert fin == [("finished", "a", table)]  # the table before it was freed
    assert sched.has_pending_kv_transfers() and not sched.has_unfinished_requests()
    sched.schedule()
    assert not sched.has_pending_kv_transfers()


def test_device_hit_first_then_connector():
    conn = RecordingConnector(offer=4)
    sched = make_sched(connector=conn)
    runner = FakeRunner()
    first = make_req("a", 13, max_tokens=1)
    sched.add_request(first)
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    second = make_req("b", list(first.prompt_token_ids) + [1, 2, 3, 4, 5, 6, 7], max_tokens=1)
    sched.add_request(second)
    out = sched.schedule()
    match = [c for c in conn.calls if c[0] == "match" and c[1] == "b"]
    assert match == [("match", "b", 12, 4)]  # asked past the 12 cached tokens (3 full blocks)
    [sr] = [s for s in out.scheduled if s.req_id == "b"]
    assert sr.start_pos == 16 and second.num_cached_tokens == 16
    sched.check_invariants(out)


def test_aborted_waiting_request_reaches_request_finished():
    from pagedllm.core.request import RequestStatus

    conn = RecordingConnector(offer=0)
    sched = make_sched(connector=conn)
    sched.add_request(make_req("w", 5))
    sched.finish_requests("w", RequestStatus.FINISHED_ABORTED)
    assert ("finished", "w", []) in conn.calls
