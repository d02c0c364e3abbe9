"""Operating the server: Prometheus metrics (`metrics`), the dashboard's feed
(`dashboard`), and the web page with its static files (`page`, `web/`)."""
