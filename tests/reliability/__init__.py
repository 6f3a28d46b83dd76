"""`make reliability` and `make soak`: mixed load through a stack that is being broken (issue 25).

agent.py is the agent (its ledger counts executions), faults.py the stack and its faults,
ledger.py the verdicts and the table, load.py the callers, run.py the command line.
"""
