"""A user's own CNNs for tests/unit/test_inspect_cnn.py: torchvision's ResNet (`torchvision.models.resnet`,
BasicBlock variant) written out, because torchvision's wheel does not load beside the CPU build of torch
2.13.0 (docs/models.md). Same module names, layer order, forward and parameter count as torchvision's
`resnet18(num_classes=...)` and, with Bottleneck blocks, `resnet50`; `width` scales the channels (64 in
torchvision) to keep tests small. `small`: a MobileNet-like layout, `features` then `classifier`."""
import torch
from torch import nn


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, layers: list[int], num_classes: int = 1000, width: int = 64):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(2 * width, layers[1], stride=2)
        self.layer3 = self._make_layer(4 * width, layers[2], stride=2)
        self.layer4 = self._make_layer(8 * width, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width, num_classes)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes, stride), nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


def resnet18(num_classes: int = 1000, width: int = 64) -> ResNet:
    return ResNet([2, 2, 2, 2], num_classes, width)


def resnet34(num_classes: int = 1000, width: int = 64) -> ResNet:
    return ResNet([3, 4, 6, 3], num_classes, width)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class BottleneckResNet(ResNet):
    """torchvision's ResNet with Bottleneck blocks (resnet50: [3, 4, 6, 3])."""

    def __init__(self, layers: list[int], num_classes: int = 1000, width: int = 64):
        nn.Module.__init__(self)
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_bottlenecks(width, layers[0])
        self.layer2 = self._make_bottlenecks(2 * width, layers[1], stride=2)
        self.layer3 = self._make_bottlenecks(4 * width, layers[2], stride=2)
        self.layer4 = self._make_bottlenecks(8 * width, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width * Bottleneck.expansion, num_classes)

    def _make_bottlenecks(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * Bottleneck.expansion, stride),
                                       nn.BatchNorm2d(planes * Bottleneck.expansion))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)


def resnet50(num_classes: int = 1000, width: int = 64) -> ResNet:
    return BottleneckResNet([3, 4, 6, 3], num_classes, width)


class Small(nn.Module):
    """A MobileNet-like layout: `features` (a stem convolution, then blocks) and `classifier`, two Sequentials
    side by side, with pooling and flattening between them in forward."""

    def __init__(self, num_classes: int = 10, width: int = 16, depth: int = 3):
        super().__init__()
        stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.features = nn.Sequential(stem, *(BasicBlock(width, width) for _ in range(depth)))
        self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Linear(width, num_classes))

    def forward(self, x):
        x = self.features(x)
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        return self.classifier(x)


def small(num_classes: int = 10, width: int = 16, depth: int = 3) -> Small:
    return Small(num_classes, width, depth)


class TwoHeads(nn.Module):
    """A multi-task model: a ResNet-18 trunk and two classification heads in an nn.ModuleDict (two Linears: modules
    of one class, but not blocks)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.trunk = resnet18(num_classes=16, width=width)
        self.heads = nn.ModuleDict({"coarse": nn.Linear(16, 4), "fine": nn.Linear(16, 10)})

    def forward(self, x):
        features = self.trunk(x)
        return torch.cat([head(features) for head in self.heads.values()], dim=-1)


def two_heads(width: int = 8) -> TwoHeads:
    return TwoHeads(width)
