"""The five seed write-ups as data (their claims and how each is looked up in results), the
verdicts beside this run's measurements, and the audit of a user's own training set-up."""
