"""Headless execution of saved workflows (`tightrope run`) through the same node classes ComfyUI calls.

    graph = load_workflow("workflow.json", NODE_CLASS_MAPPINGS)   # UI or API format -> validated graph
    results = run_workflow(graph, NODE_CLASS_MAPPINGS)            # {node_id: NodeOutputs}
"""
from .executor import NodeExecutionError, NodeOutputs, run_workflow
from .graph import Link, NodeSpec, WorkflowError
from .workflow_format import load_workflow

__all__ = ["load_workflow", "run_workflow", "Link", "NodeSpec", "NodeOutputs", "WorkflowError", "NodeExecutionError"]
