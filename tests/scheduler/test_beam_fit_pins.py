"""What a sequence holds behind a sliding window (``beam_fit.sequence_need``), at the lengths
where the oldest unit the newest token reads changes."""
from vmemkv.scheduler.beam_fit import sequence_need

UNIT = 4
WINDOW = [(8, 1, lambda fill: 1)]    # one kind, an 8-token window, one pool unit a unit


def test_the_unit_holding_the_oldest_token_the_window_reads_is_still_held():
    # 11 tokens: the newest (10) reads tokens 3..10, so units 0, 1 and 2 are held
    assert sequence_need(4, 11, UNIT, WINDOW) == 3
    # 12 tokens: the newest (11) reads 4..11: unit 0 given back, units 1 and 2 held; but on
    # the way there (11 tokens) three were held
    assert sequence_need(4, 12, UNIT, WINDOW) == 3
    assert sequence_need(4, 8, UNIT, WINDOW) == 2
