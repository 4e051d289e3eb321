"""Metric metadata on the registry generates every list of score columns (store, report table, CSV export)."""
from __future__ import annotations

import math

import torch

from leakbench.data import DATASETS, OFFLINE
from leakbench.evaluation.store import MEAN_COLUMNS
from leakbench.metrics import METRICS, SCORES, MetricInfo, compare, score_columns
from leakbench.report.export import RESULT_COLUMNS
from leakbench.report.tables import METRIC_ROWS, metrics_table


def test_every_list_of_score_columns_comes_from_the_registry():
    assert score_columns() == ("mse", "rmse", "psnr", "ssim", "label_acc")
    assert MEAN_COLUMNS == score_columns()
    assert tuple(k for k, _ in METRIC_ROWS) == (*score_columns(), "seconds")
    assert [label for _, label in METRIC_ROWS][:5] == [SCORES[k].label for k in score_columns()]
    start = RESULT_COLUMNS.index("mse")
    assert RESULT_COLUMNS[start:start + len(score_columns())] == score_columns()


def test_each_registered_metric_carries_its_direction():
    for name in METRICS.names():
        info = METRICS.info(name)
        assert isinstance(info, MetricInfo) and info.label
    x = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    close, far = x + 0.01, torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    for name in METRICS.names():
        better = METRICS.get(name)(close, x).mean() > METRICS.get(name)(far, x).mean()
        assert bool(better) == METRICS.info(name).higher_is_better, name
    # compare reports every score the registry lists, and the table prints them in their formats
    scores = compare(close, x)
    assert set(score_columns()) <= set(scores)
    table = metrics_table(scores)
    assert f"{scores['psnr']:.2f}" in table and SCORES["psnr"].format(math.inf) == "inf"


def test_offline_datasets_come_from_the_registry():
    assert set(OFFLINE) == {"digits", "photos", "sphere", "gaussian-mixture", "text"}
    assert all(DATASETS.info(n).offline == (n in OFFLINE) for n in DATASETS.names())
