"""The private CA (L{llmgw.tlsconf.ca}) and TLS options for both ends (L{llmgw.tlsconf.options})."""
