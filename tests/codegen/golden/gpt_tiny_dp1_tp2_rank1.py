# Xirang program of rank 1: mesh dp=1 x pp=1 x tp=2, dp 0 pp 0 tp 1, precision fp32, schedule 1f1b

# stage 0: receives [], sends ['the loss']
def forward(self, p_tok_emb_weight, p_pos_emb_weight, p_layers_0_ln1_weight, p_layers_0_ln1_bias, p_layers_0_attn_qkv_weight, p_layers_0_attn_qkv_bias, p_layers_0_attn_proj_weight, p_layers_0_attn_proj_bias, p_layers_0_ln2_weight, p_layers_0_ln2_bias, p_layers_0_mlp_up_weight, p_layers_0_mlp_up_bias, p_layers_0_mlp_down_weight, p_layers_0_mlp_down_bias, p_layers_1_ln1_weight, p_layers_1_ln1_bias, p_layers_1_attn_qkv_weight, p_layers_1_attn_qkv_bias, p_layers_1_attn_proj_weight, p_layers_1_attn_proj_bias, p_layers_1_ln2_weight, p_layers_1_ln2_bias, p_layers_1_mlp_up_weight, p_layers_1_mlp_up_bias, p_layers_1_mlp_down_weight, p_layers_1_mlp_down_bias, p_ln_f_weight, p_ln_f_bias, input_ids, labels):
    tp_group = self.tp_group
    comm_counter = self.comm_counter
    arange = torch.ops.aten.arange.default(16, device = device(type='cpu'), pin_memory = False)
    embedding = torch.ops.aten.embedding.default(p_tok_emb_weight, input_ids);  input_ids = None
    embedding_1 = torch.ops.aten.embedding.default(p_pos_emb_weight, arange);  p_pos_emb_weight = arange = None
    add = torch.ops.aten.add.Tensor(embedding, embedding_1);  embedding = embedding_1 = None
    dropout = torch.ops.aten.dropout.default(add, 0.0, True);  add = None
    layer_norm = torch.ops.aten.layer_norm.default(dropout, [64], p_layers_0_ln1_weight, p_layers_0_ln1_bias, 1e-05, False);  p_layers_0_ln1_weight = p_layers_0_ln1_bias = None
    copy_to_group = xirang_codegen_ops_collectives_copy_to_group(layer_norm, tp_group, counter = comm_counter);  layer_norm = None
    linear = torch.ops.aten.linear.default(copy_to_group, p_layers_0_attn_qkv_weight, p_layers_0_attn_qkv_bias);  copy_to_group = p_layers_0_attn_qkv_weight = p_layers_0_attn_qkv_bias = None
    split = torch.ops.aten.split.Tensor(linear, 32, -1);  linear = None
    getitem = split[0]
    getitem_1 = split[1]
    getitem_2 = split[2];  split = None
    view = torch.ops.aten.view.default(getitem, [4, 16, 2, 16]);  getitem = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    view_1 = torch.ops.aten.view.default(getitem_1, [4, 16, 2, 16]);  getitem_1 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
    view_2 = torch.ops.aten.view.default(getitem_2, [4, 16, 2, 16]);  getitem_2 = None
    transpose_2 = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(transpose, transpose_1, transpose_2, None, 0.0, True);  transpose = transpose_1 = transpose_2 = None
    transpose_3 = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
    reshape = torch.ops.aten.reshape.default(transpose_3, [4, 16, 32]);  transpose_3 = None
    partial_from_replicate = xirang_codegen_ops_local_ops_partial_from_replicate(p_layers_0_attn_proj_bias, False);  p_layers_0_attn_proj_bias = None
    linear_1 = torch.ops.aten.linear.default(reshape, p_layers_0_attn_proj_weight, partial_from_replicate);  reshape = p_layers_0_attn_proj_weight = partial_from_replicate = None
    reduce_from_group = xirang_codegen_ops_collectives_reduce_from_group(linear_1, tp_group, counter = comm_counter);  linear_1 = None
    dropout_1 = torch.ops.aten.dropout.default(reduce_from_group, 0.0, True);  reduce_from_group = None
    add_1 = torch.ops.aten.add.Tensor(dropout, dropout_1);  dropout = dropout_1 = None
    layer_norm_1 = torch.ops.aten.layer_norm.default(add_1, [64], p_layers_0_ln2_weight, p_layers_0_ln2_bias, 1e-05, False);  p_layers_0_ln2_weight = p_layers_0_ln2_bias = None
    copy_to_group_1 = xirang_codegen_ops_collectives_copy_to_group(layer_norm_1, tp_group, counter = comm_counter);  layer_norm_1 = None
    linear_2 = torch.ops.aten.linear.default(copy_to_group_1, p_layers_0_mlp_up_weight, p_layers_0_mlp_up_bias);  copy_to_group_1 = p_layers_0_mlp_up_weight = p_layers_0_mlp_up_bias = None
    gelu = torch.ops.aten.gelu.default(linear_2);  linear_2 = None
    partial_from_replicate_1 = xirang_codegen_ops_local_ops_partial_from_replicate(p_layers_0_mlp_down_bias, False);  p_layers_0_mlp_down_bias = None
    linear_3 = torch.ops.aten.linear.default(gelu, p_layers_0_mlp_down_weight, partial_from_replicate_1);  gelu = p_layers_0_mlp_down_weight = partial_from_replicate_1 = None
    reduce_from_group_1 = xirang_codegen_ops_collectives_reduce_from_group(linear_3, tp_group, counter = comm_counter);  linear_3 = None
    dropout_2 = torch.ops.aten.dropout.default(reduce_from_group_1, 0.0, True);  reduce_from_group_1 = None
    add_2 = torch.ops.aten.add.Tensor(add_1, dropout_2);  add_1 = dropout_2 = None
    layer_norm_2 = torch.ops.aten.layer_norm.default(add_2, [64], p_layers_1_ln1_weight, p_layers_1_ln1_bias, 1e-05, False);  p_layers_1_ln1_weight = p_layers_1_ln1_bias = None
    copy_to_group_2 = xirang_codegen_ops_collectives_copy_to_group(layer_norm_2, tp_group, counter = comm_counter);  layer_norm_2 = None
    linear_4 = torch.ops.aten.linear.default(copy_to_group_2, p_layers_1_attn_qkv_weight, p_layers_1_attn_qkv_bias);  copy_to_group_2 = p_layers_1_attn_qkv_weight = p_layers_1_attn_qkv_bias = None
    split_1 = torch.ops.aten.split.Tensor(linear_4, 32, -1);  linear_4 = None
    getitem_3 = split_1[0]
    getitem_4 = split_1[1]
    getitem_5 = split_1[2];  split_1 = None
    view_3 = torch.ops.aten.view.default(getitem_3, [4, 16, 2, 16]);  getitem_3 = None
    transpose_4 = torch.ops.aten.transpose.int(view_3, 1, 2);  view_3 = None
    view_4 = torch.ops.aten.view.default(getitem_4, [4, 16, 2, 16]);  getitem_4 = None
    transpose_5 = torch.ops.aten.transpose.int(view_4, 1, 2);  view_4 = None
    view_5 = torch.ops.aten.view.default(getitem_5, [4, 16, 2, 16]);  getitem_5 = None
    transpose_6 = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None
    scaled_dot_product_attention_1 = torch.ops.aten.scaled_dot_product_attention.default(transpose_4, transpose_5, transpose_6, None, 0.0, True);  transpose_4 = transpose_5 = transpose_6 = None
    transpose_7 = torch.ops.aten.transpose.int(scaled_dot_product_attention_1, 1, 2);  scaled_dot_product_attention_1 = None
    reshape_1 = torch.ops.aten.reshape.default(transpose_7, [4, 16, 32]);  transpose_7 = None
    partial_from_replicate_2 = xirang_codegen_ops_local_ops_partial_from_replicate(p_layers_1_attn_proj_bias, False);  p_layers_1_attn_proj_bias = None
    linear_5 = torch.ops.aten.linear.default(reshape_1, p_layers_1_attn_proj_weight, partial_from_replicate_2);  reshape_1 = p_layers_1_attn_proj_weight = partial_from_replicate_2 = None
    reduce_from_group_2 = xirang_codegen_ops_collectives_reduce_from_group(linear_5, tp_group, counter = comm_counter);  linear_5 = None
    dropout_3 = torch.ops.aten.dropout.default(reduce_from_group_2, 0.0, True);  reduce_from_group_2 = None
    add_3 = torch.ops.aten.add.Tensor(add_2, dropout_3);  add_2 = dropout_3 = None
    layer_norm_3 = torch.ops.aten.layer_norm.default(add_3, [64], p_layers_1_ln2_weight, p_layers_1_ln2_bias, 1e-05, False);  p_layers_1_ln2_weight = p_layers_1_ln2_bias = None
    copy_to_group_3 = xirang_codegen_ops_collectives_copy_to_group(layer_norm_3, tp_group, counter = comm_counter);  layer_norm_3 = None
    linear_6 = torch.ops.aten.linear.default(copy_to_group_3, p_layers_1_mlp_up_weight, p_layers_1_mlp_up_bias);  copy_to_group_3 = p_layers_1_mlp_up_weight = p_layers_1_mlp_up_bias = None
    gelu_1 = torch.ops.aten.gelu.default(linear_6);  linear_6 = None
    partial_from_replicate_3 = xirang_codegen_ops_local_ops_partial_from_replicate(p_layers_1_mlp_down_bias, False);  p_layers_1_mlp_down_bias = None
    linear_7 = torch.ops.aten.linear.default(gelu_1, p_layers_1_mlp_down_weight, partial_from_replicate_3);  gelu_1 = p_layers_1_mlp_down_weight = partial_from_replicate_3 = None
    reduce_from_group_3 = xirang_codegen_ops_collectives_reduce_from_group(linear_7, tp_group, counter = comm_counter);  linear_7 = None
    dropout_4 = torch.ops.aten.dropout.default(reduce_from_group_3, 0.0, True);  reduce_from_group_3 = None
    add_4 = torch.ops.aten.add.Tensor(add_3, dropout_4);  add_3 = dropout_4 = None
    layer_norm_4 = torch.ops.aten.layer_norm.default(add_4, [64], p_ln_f_weight, p_ln_f_bias, 1e-05, False);  add_4 = p_ln_f_weight = p_ln_f_bias = None
    copy_to_group_4 = xirang_codegen_ops_collectives_copy_to_group(layer_norm_4, tp_group, counter = comm_counter);  layer_norm_4 = None
    scatter_to_group = xirang_codegen_ops_collectives_scatter_to_group(p_tok_emb_weight, tp_group, 0, counter = comm_counter);  p_tok_emb_weight = None
    linear_8 = torch.ops.aten.linear.default(copy_to_group_4, scatter_to_group);  copy_to_group_4 = scatter_to_group = None
    reshape_2 = torch.ops.aten.reshape.default(linear_8, [-1, 256]);  linear_8 = None
    reshape_3 = torch.ops.aten.reshape.default(labels, [-1]);  labels = None
    cross_entropy_loss = xirang_codegen_ops_vocab_parallel_vocab_parallel_cross_entropy(reshape_2, reshape_3, vocab_start = 256, vocab_size = 512, ignore_index = -100, reduction = 'mean', group = tp_group, counter = comm_counter);  reshape_2 = reshape_3 = tp_group = comm_counter = None
    return (cross_entropy_loss,)
    