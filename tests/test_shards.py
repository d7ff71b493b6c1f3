"""A data folder's shards on disk (`d3d.train.shards`): lines split as JSON needs, atomic writes,
records in shard order."""

from __future__ import annotations

import json

from d3d.train.shards import jsonl_lines, read_shards, write_atomic


def test_read_shards_on_empty_folder(tmp_path):
    """No shards yet: read_shards yields nothing."""
    assert list(read_shards(tmp_path)) == []


def test_a_line_separator_inside_a_json_string_does_not_split_a_record(tmp_path):
    """U+2028 may stand raw in a JSON string; str.splitlines() would cut the record there."""
    path = tmp_path / "records.jsonl"
    write_atomic(path, json.dumps({"text": "a\u2028b"}, ensure_ascii=False) + "\n\n" + json.dumps({"text": "c"}) + "\n")
    assert [json.loads(line)["text"] for line in jsonl_lines(path)] == ["a\u2028b", "c"]
    assert not list(tmp_path.glob(".*.tmp"))  # the staging file was renamed into place


def test_records_come_in_shard_order(tmp_path):
    (tmp_path / "shards").mkdir()
    for index, ids in ((1, [3]), (0, [1, 2])):
        write_atomic(tmp_path / "shards" / f"shard-{index:05d}.jsonl",
                     "".join(json.dumps({"id": i}) + "\n" for i in ids))
    assert [record["id"] for record in read_shards(tmp_path)] == [1, 2, 3]
