"""Two prices side by side: this CPU's and a weight-bound GPU's, and a conclusion's table under both."""

import pytest

import labkit as lk
from labkit.analysis.hardware import weight_bound_price
from labkit.analysis.prices import GPU, THIS_CPU, ByPrice, with_host_of

CPU_PRICE = lk.CostModel(overhead=1e-3, per_prefill_token=7e-5, per_decode_token=2e-4, per_kv_token=1e-6,
                         host_overhead=1e-4, host_per_request=1e-5, host_per_token=1e-6)


def test_two_prices_name_this_cpu_first_and_the_gpu_second():
    prices = lk.two_prices(CPU_PRICE)
    assert list(prices) == [THIS_CPU, GPU]
    assert prices[THIS_CPU] is CPU_PRICE and prices[GPU] == weight_bound_price()


def test_a_conclusion_is_computed_under_every_price_and_printed_as_rows():
    table = lk.by_price(lambda price: {"one row": price.device_seconds(0, 1, 0) * 1000,
                                       "eight rows": price.device_seconds(0, 8, 0) * 1000},
                        lk.two_prices(CPU_PRICE), fmt="{:.3f} ms")
    assert table.row("one row") == {THIS_CPU: pytest.approx(1.2),
                                    GPU: pytest.approx(1000 * weight_bound_price().device_seconds(0, 1, 0))}
    assert table[THIS_CPU]["eight rows"] == pytest.approx(1 + 8 * 0.2)
    lines = str(table).splitlines()
    assert lines[0].split() == ["CPU", "(saved", "fit)", "H200", "(spec", "sheet)"]
    assert lines[1].split()[:4] == ["one", "row", "1.200", "ms"] and lines[2].startswith("eight rows")


def test_rows_that_differ_between_prices_are_refused():
    with pytest.raises(ValueError, match="every price needs the same rows"):
        ByPrice({"a": {"x": 1.0}, "b": {"y": 1.0}})


def test_the_gpu_with_this_cpus_host_keeps_the_gpus_device_and_the_cpus_host():
    both = with_host_of(weight_bound_price(), CPU_PRICE)
    assert both.device_seconds(3, 5, 7) == weight_bound_price().device_seconds(3, 5, 7)
    assert both.host_seconds(4, 9) == CPU_PRICE.host_seconds(4, 9)
    assert weight_bound_price().host_seconds(4, 9) == 0  # negative control: the roofline alone has no host


def test_rows_may_have_formats_of_their_own():
    table = lk.by_price(lambda price: {"ratio": 1.5, "share": 0.25}, lk.two_prices(CPU_PRICE), fmt={"share": "{:.0%}"})
    assert [line.split()[1:] for line in str(table).splitlines()[1:]] == [["1.50x", "1.50x"], ["25%", "25%"]]
