"""workers/records.py: the bounded per-request record behind /debug/requests/<id>."""

import pytest

from splitserve.workers.records import RequestRecords


def test_fields_merge_and_the_oldest_record_goes_first():
    records = RequestRecords(capacity=2)
    records.update("a", queue_s=0.1, trace_id=None)
    records.update("a", first_token_s=0.5)
    assert records.get("a") == {"request_id": "a", "queue_s": 0.1, "first_token_s": 0.5}  # None is not stored
    records.update("b", queue_s=0.2)
    records.update("c", queue_s=0.3)
    assert records.get("a") is None and records.get("b") is not None and len(records) == 2
    copy = records.get("c")
    copy["queue_s"] = 9
    assert records.get("c")["queue_s"] == 0.3  # a copy: readers cannot change the record


def test_capacity_is_validated():
    with pytest.raises(ValueError, match="allowed: >= 1"):
        RequestRecords(capacity=0)
