"""`featcache reproduce`: one TOML pipeline per paper table or figure -> extract, train, and a markdown table with our
numbers beside the paper's (plus a PNG where the target is a figure).

A pipeline (pipelines/NAME.toml) holds:

    name, title                      the Make target (= the file's stem) and what the table shows
    paper_dataset                    the dataset the paper used: taken when --data-root is given without --dataset
    note                             how the paper's setting maps onto the data at hand (printed with the table)
    extra_rows                       rows we report that the paper's table does not have
    set                              settings for every run (a column's, a run's and the profile's set win, in order)
    [extract]                        featcache.extract keyword arguments (noise = {kind, scale, p};
                                     domains = [..] for every dataset, or {dataset = [..]} per dataset)
    [columns."PAPER COLUMN"]         metric (metrics.METRICS), and optional extract / set / backbones / x overrides for
                                     the cells of that column; a paper column without an entry is not reproduced
    [[run]]                          row (a paper row), algo, set = {setting = value}, backbones = [indices into the
                                     extract's backbone list] (default: all), extract = {overrides}, columns = [only
                                     these], grid = {setting = [values]} (validation-select, then train the best)
                                     or search = {space = {setting = [values] or "loguniform:a,b"}, sampler,
                                     pruner, trials, rungs, reduction} (featcache.search, then train the best)
    [paper]                          name (fedpcl | fedproc | fedpft), table ("Table 2"), source, columns = [the
                                     paper's columns], rows = {row = [cells: "mean(std)", a number or "-"]}, claims,
                                     backbones = [{arch (timm name), weights (a word naming the checkpoint, e.g.
                                     quickdraw), dim, frozen (false: trained end to end)}] (agreement.comparability);
                                     optional: a pipeline of one's own leaves it out, its rows are its runs', its
                                     columns its [columns], its table ours only, titled by name and title
    [figure]                         kind = lines | heatmap, xlabel, ylabel, xscale, normalize = column
    [profiles.quick], [profiles.full]   rounds, seeds, and optional set / extract / columns / rows overrides, and
                                     trials (every searching row's trial budget; it wins over the row's)

Metrics (metrics.py): acc (final round: mean(std) over seeds of the unweighted client mean), best (best round per
seed), global (the server's aggregated model on the union of the clients' test splits; n/a without a server model),
params (floats uploaded per client per round), trainable (trainable head parameters per client), fixed (frozen
backbone parameters), domain:NAME[|ALT..] (clients of the first of these domains the data has), fair:KEY
(metrics.fairness; fair:std is FedPCL's "Variance"), probe:origin|probe|match (FedPFT Table 1, analyses.probe_match
on the trained state), protosim:DOMAIN (FedPCL Figure 3, analyses.backbone_similarity: the row's backbone's share of
the all-backbone model's prototypes).

The modules, in the order a run goes through them: schema (read and validate the file), plan (cells -> shared jobs),
run (find the file, extract, resolve each job's RunSpec and train it through runs.train / runs.select, memoise),
render (values, table, markdown, figure); analyses holds the paper analyses of a trained state that metrics compute.
"""

from __future__ import annotations

from .metrics import METRICS, fmt_value, metric_value
from .plan import DEFAULT_PROFILE, Job, plan, resolve_extract
from .render import cell_values, column_labels, command_line, render, table_markdown
from .run import TRAIN_DEVICE, load_pipeline, pipeline_dirs, pipeline_path, reproduce, run_job
from .schema import Pipeline, parse_pipeline

__all__ = [
    "DEFAULT_PROFILE",
    "METRICS",
    "TRAIN_DEVICE",
    "Job",
    "Pipeline",
    "cell_values",
    "column_labels",
    "command_line",
    "fmt_value",
    "load_pipeline",
    "metric_value",
    "parse_pipeline",
    "pipeline_dirs",
    "pipeline_path",
    "plan",
    "render",
    "reproduce",
    "resolve_extract",
    "run_job",
    "table_markdown",
]
