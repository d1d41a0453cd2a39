"""
Tests for the twistd dropin and the tap.
"""

from __future__ import annotations

from twisted.application.service import IServiceMaker
from twisted.plugin import getPlugins
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from llmgw import tap


class PluginTests(SynchronousTestCase):
    def test_found(self) -> None:
        """
        getPlugins(IServiceMaker) finds `llmgw`, pointing at llmgw.tap.
        """
        makers = {p.tapname: p for p in getPlugins(IServiceMaker)}
        self.assertIn("llmgw", makers)
        self.assertEqual(makers["llmgw"].module, "llmgw.tap")

    def test_subcommand_required(self) -> None:
        """
        `twistd llmgw` without a kind is a usage error listing the kinds.
        """
        with self.assertRaises(usage.UsageError) as e:
            tap.Options().parseOptions([])
        self.assertIn("control", str(e.exception))
