"""kuangchao_core.obs"""
