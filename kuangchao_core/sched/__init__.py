"""kuangchao_core.sched"""
