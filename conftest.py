"""nbval settings: plotly's JSON output embeds its whole template, which changes across
plotly releases, so compare the text outputs of lesson cells and skip plotly's mime types."""


def pytest_collectstart(collector):
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("application/vnd.plotly.v1+json", "text/html")
