"""Synthetic tasks of the xLSTM paper: formal languages (Figure 4: `formal`, `formal_paper`,
`registry`) and multi-query associative recall (`mqar`), the baseline models they are compared
with (`baselines`), the experiment runner (`experiment`) and the paper's protocol (`protocol`).
The command line is `xlstm_kit.cli.experiment` (`xlstm-kit experiment ...`)."""
