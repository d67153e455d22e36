"""JSON values compared as a request means them (`specserve/json_values.py`)."""

import pytest

from specserve.json_values import one_of


@pytest.mark.parametrize("value, values, expected", [
    (False, (False, None), True),
    (0, (False, None), False),      # Python: 0 == False
    (1, (True,), False),
    (1.0, (1,), False),
    (1, (1, 2.5), True),
    (None, (None,), True),
    ([], ([],), True),
    ({"a": 1}, ({"a": 1.0},), True),  # containers compare by ==, as json.loads gives them
    ("", (None,), False),
])
def test_one_of_tells_a_type_from_another_of_equal_value(value, values, expected):
    assert one_of(value, values) is expected
