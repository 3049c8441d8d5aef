"""The next step's batches are fetched and on their way to the device before the step starts."""

import torch

from optimus.data.prefetch import DeviceBatches


def _batches(log: list):
    i = 0
    while True:
        log.append(i)
        yield {"input_ids": torch.full((2, 4), i), "labels": torch.full((2, 4), i),
               "sample_ids": torch.tensor([2 * i, 2 * i + 1])}
        i += 1


def test_ahead_fetches_the_next_steps_microbatches_before_it_takes_them():
    fetched = []
    batches = DeviceBatches(_batches(fetched), microbatches=2, device=torch.device("cpu"))
    first = batches.take()  # nothing ahead yet: fetched now
    assert [int(mb["input_ids"][0, 0]) for mb in first] == [0, 1] and fetched == [0, 1]
    batches.ahead()
    assert fetched == [0, 1, 2, 3]  # the next step's, before it starts
    batches.ahead()  # once per step: already ahead
    assert fetched == [0, 1, 2, 3]
    second = batches.take()
    assert [int(mb["labels"][0, 0]) for mb in second] == [2, 3] and fetched == [0, 1, 2, 3]
    assert second[1]["sample_ids"].tolist() == [6, 7]  # stays on the host, as it came


def test_a_replaced_iterator_drops_what_was_fetched_ahead_from_the_old_one():
    fetched = []
    batches = DeviceBatches(_batches(fetched), microbatches=1, device=torch.device("cpu"))
    batches.take()
    batches.ahead()  # batch 1, on its way
    batches.replace(iter([{"input_ids": torch.zeros(1, 4), "labels": torch.zeros(1, 4),
                           "sample_ids": torch.tensor([99])}]))
    (mb,) = batches.take()
    assert mb["sample_ids"].tolist() == [99]  # the window's next batch, not batch 1
