"""The web page: its templates, its handlers and the form over the YAML."""
