"""The team dashboard: browser sessions, the read endpoints its pages poll, and the pages themselves."""
