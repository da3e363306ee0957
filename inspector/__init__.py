"""A local, read-only web page over a session log: sessions, turns, requests, budget."""
